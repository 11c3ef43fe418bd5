// The CPU attention library: one translation unit per instruction-set build (build.py compiles this file once per
// ISA, with -I for this folder), made of every kernel family's torch binding. Each family lives in its own folder,
// its binding beside its torch-free headers and its Python op; the headers they share are here (core.h, vec.h,
// binding.h). One unit, not one per family: ATen's headers are parsed once, and a build is one compile.
#include "teaching/teaching.cpp"  // v1, v2 (teaching.h)
#include "flash/flash.cpp"        // v3, varlen, AMX (flash.h, flash_tiles.h, flash_bf16dot.h, flash_amx.h)
