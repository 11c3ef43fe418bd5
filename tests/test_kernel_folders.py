"""A kernel is a folder: each C++ CPU attention family (flash/, teaching/) holds its binding, its headers and its
Python op; each op's signature is written once (schema.py); the notebooks print the source by file and function.

What is checked: every op of schema.OPS is implemented by exactly one family's .cpp (``m.impl``) and wrapped by that
family's Python module, and no C++ file writes a schema; each family's registry entries come from its own module;
btlib.kernels.cpu.source.show prints the functions notebooks 04 and 08 name, and refuses a file btlib does not
compile or a function the file does not define.
"""

import re

import pytest

from btlib.kernels import registry
from btlib.kernels.cpu import build, flash, schema, source, teaching


def test_each_op_is_declared_once_and_implemented_by_one_family():
    impls = {}
    for family in build.FOLDERS:
        text = (build.HERE / family / f"{family}.cpp").read_text()
        for name in re.findall(r'm\.impl\("(\w+)"', text):
            impls.setdefault(name, []).append(family)
    assert impls == {name: [impls[name][0]] for name in schema.OPS}  # every op, one family each
    for path in [*build.SOURCES, *build.HEADERS]:
        text = path.read_text()
        for name in schema.OPS:
            assert f'"{name}(' not in text, f"{path.name} writes the schema of {name}: schema.py is its one place"
    modules = {"flash": flash, "teaching": teaching}
    for name, (family,) in impls.items():
        fn = next(f for f in vars(modules[family]).values() if callable(f) and schema.OPS[name].schema in (f.__doc__ or ""))
        assert fn.__module__ == "btlib.kernels.cpu.ops"  # the wrapper derived from the schema, not written again


def test_each_family_registers_its_own_kernels():
    by_module = {k.name: k.fn for k in registry.kernels(backend="cpp")}
    assert {by_module["cpu_naive_v1"], by_module["cpu_tiled_v2"]} == {teaching.attention_v1, teaching.attention_v2}
    assert {by_module["cpu_flash_v3"], by_module["cpu_flash_varlen"], by_module["cpu_amx_varlen"]} == {
        flash.attention_v3, flash.varlen_attention_v3, flash.varlen_attention_amx}
    v1, v3 = registry.get("cpu_naive_v1"), registry.get("cpu_flash_v3")
    assert (v1.window, v1.bias, v3.window, v3.bias) == (False, False, True, True)  # from the schemas
    with pytest.raises(TypeError, match="attention_v1 takes no window"):
        teaching.attention_v1(*[None] * 3, window=(1, 1))


@pytest.mark.parametrize("path, function, first", [
    ("flash/flash.h", "online_softmax_row", "// Online softmax of one row"),
    ("flash/flash.h", "flash_block", None),
    ("flash/flash_tiles.h", "qk_tile", None),
    ("flash/flash_tiles.h", "pv_tile", None),
    ("flash/flash_bf16dot.h", "qk_tile_bf16", None),
    ("vec.h", "vexp2", "// 2^x for x <= 0"),
    ("core.h", "key_lo", None),
    ("core.h", "key_hi", None),
])
def test_show_prints_the_functions_the_notebooks_name(capsys, path, function, first):
    source.show(path, function)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"--- btlib/kernels/cpu/{path}: {function}"
    body = "\n".join(out[1:])
    assert re.search(rf"\b{function}\s*\(", body) and body.rstrip().endswith("}")
    assert body.count("{") == body.count("}")  # the whole function, no more
    if first:
        assert out[1].startswith(first)  # with the comment above it


def test_show_a_file_and_matching_lines(capsys):
    source.show("flash/flash.cpp")
    out = capsys.readouterr().out
    assert out.startswith("--- btlib/kernels/cpu/flash/flash.cpp\n/*") and out.rstrip().endswith("*/")
    source.show("flash/flash.h", "flash_block", matching=r"key_lo\(|key_hi\(")
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines and all(re.match(r"\s*\d+  |     \.\.\.$", line) for line in lines)
    assert any("key_lo(" in line for line in lines) and any("key_hi(" in line for line in lines)


def test_show_refuses_what_btlib_does_not_compile():
    with pytest.raises(FileNotFoundError, match="btlib compiles no 'flash.h'"):
        source.show("flash.h", "flash_block")  # moved into flash/
    with pytest.raises(LookupError, match="defines no function 'no_such_function'"):
        source.show("flash/flash.h", "no_such_function")
