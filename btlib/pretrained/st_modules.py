"""sentence-transformers' modules after the Transformer: Pooling, Dense, Normalize, one small class each.

A sentence-transformers folder is a list of modules (modules.json: each entry's ``type`` and ``path``,
in order). The first is the Transformer (btlib's encoder itself); the rest turn its token states into
one sentence vector. btlib reproduces sentence-transformers 6.2's maths for each, on packed tokens:

    lengths [3, 2] -> token states h (5, d), cu_seqlens [0, 3, 5]
    -> PoolingModule (B, k * d)  -> DenseModule (B, out)  -> NormalizeModule (B, out)

Adding a module type adds one class here with ``TYPE`` (the class name modules.json ends with),
``load(folder, d_in)`` (its config and weights; unknown keys refused by name) and ``forward``.
:class:`SentenceHead` runs the list; ``truncate_dim`` (config_sentence_transformers.json) cuts the
result last, as ``SentenceTransformer.encode`` does.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..padding import packed_positions, segment_ids, segment_mean, segment_sum
from .folders.checkpoint import CheckpointError

__all__ = ["PoolingModule", "DenseModule", "NormalizeModule", "SentenceHead", "Pooling", "as_head", "HasHead", "MODULE_TYPES",
           "POOLING_MODES"]

# sentence-transformers' order: the legacy pooling_mode_* keys concatenate in this order.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def read_json(path: Path, what: str) -> dict:
    """A JSON object file; {} when absent; CheckpointError naming the file when it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore the {what} from the model's source") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not the object of {what} fields")
    return data


def _unknown(config: dict, known: set[str], path: Path, kind: str) -> None:
    extra = sorted(set(config) - known)
    if extra:
        raise CheckpointError(f"{path}: {kind} option(s) {extra} are not supported by btlib (it knows {sorted(known)}); "
                              "use sentence-transformers for this model")


def _flag(config: dict, key: str, default: bool, path: Path) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: {key} must be true or false; got {value!r}")
    return value


class PoolingModule(nn.Module):
    """Token states -> one vector per sequence; several modes are concatenated in the order given.

    modes: any of POOLING_MODES. include_prompt=False leaves the prompt's tokens out of every mode, as
    sentence-transformers does (the prompt length counts the leading special token: [CLS] + prompt).
    """

    TYPE = "Pooling"

    def __init__(self, d: int, modes: tuple[str, ...] = ("mean",), include_prompt: bool = True):
        super().__init__()
        bad = [m for m in modes if m not in POOLING_MODES]
        if bad or not modes:
            raise ValueError(f"pooling modes must be a non-empty list of {POOLING_MODES}; got {modes!r}")
        self.d, self.modes, self.include_prompt = d, tuple(modes), include_prompt

    def extra_repr(self) -> str:
        return f"modes={self.modes}, include_prompt={self.include_prompt}"

    def output_dim(self, d: int) -> int:
        return len(self.modes) * d

    @classmethod
    def load(cls, folder: Path, d: int) -> "PoolingModule":
        path = folder / "config.json"
        c = read_json(path, "Pooling config")
        _unknown(c, {"embedding_dimension", "word_embedding_dimension", "pooling_mode", "include_prompt", *_LEGACY_KEYS},
                 path, "Pooling")
        dim = c.get("embedding_dimension", c.get("word_embedding_dimension", d))
        if dim != d or isinstance(dim, bool):
            raise CheckpointError(f"{path}: embedding_dimension {dim!r} is not the Transformer's hidden size {d}")
        mode = c.get("pooling_mode")
        if mode is None:
            legacy = [key for key in _LEGACY_KEYS if key in c]
            for key in legacy:
                _flag(c, key, False, path)
            mode = tuple(_LEGACY_KEYS[k] for k in _LEGACY_KEYS if c.get(k)) or ("mean",)
        modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, (list, tuple)) else None
        if not modes or any(m not in POOLING_MODES for m in modes):
            raise CheckpointError(f"{path}: pooling_mode {mode!r} is not one of {POOLING_MODES} (or a list of them); "
                                  "use sentence-transformers for this model")
        return cls(d, modes, _flag(c, "include_prompt", True, path))

    def forward(self, h: Tensor, cu_seqlens: Tensor, prompt_length: int | None = None) -> Tensor:
        """h (total, d) float32 packed token states, cu_seqlens (B + 1,) -> (B, len(modes) * d) float32."""
        B, d = cu_seqlens.numel() - 1, h.shape[1]
        starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
        seq = segment_ids(lengths)  # (total,) sequence of each token
        pos = packed_positions(cu_seqlens, h.shape[0])  # (total,) offset inside its sequence
        P = 0 if self.include_prompt or not prompt_length else int(prompt_length)
        keep = pos >= P  # sentence-transformers zeroes the prompt's positions in the attention mask
        n = (lengths - P).clamp(min=0)  # tokens pooled per sequence
        hk, sk = h[keep], seq[keep]
        out = []
        for mode in self.modes:
            if mode in ("cls", "lasttoken"):
                # cls: first pooled token (the first token when none is left); lasttoken: zeros when none is left
                idx = starts + torch.where(lengths > P, P, 0) if mode == "cls" else starts + lengths - 1
                ok = (lengths > 0) if mode == "cls" else (n > 0)
                out.append(torch.where(ok.view(-1, 1), h[idx.clamp(0, max(h.shape[0] - 1, 0))], 0.0)
                           if h.shape[0] else h.new_zeros(B, d))
            elif mode == "max":
                init = h.new_full((B, d), float("-inf"))  # a sequence with nothing pooled stays -inf, as in s-t
                out.append(init.scatter_reduce(0, sk.view(-1, 1).expand(-1, d), hk, reduce="amax"))
            elif mode == "mean":
                out.append(segment_mean(hk, sk, n))
            elif mode == "mean_sqrt_len_tokens":
                out.append(segment_sum(hk, sk, B) / n.to(h.dtype).clamp(min=1e-9).sqrt().view(-1, 1))
            else:  # weightedmean: token i of a sequence weighs i + 1 (prompt tokens keep their positions' weights)
                w = (pos[keep] + 1).to(h.dtype)
                out.append(segment_mean(hk * w.view(-1, 1), sk, segment_sum(w, sk, B)))
        return torch.cat(out, dim=-1)


def _activation(name: object, path: Path) -> nn.Module:
    """A torch.nn module class named by its dotted path (what s-t writes), built without arguments."""
    if not isinstance(name, str) or not name.startswith("torch.nn."):
        raise CheckpointError(f"{path}: activation_function {name!r} is not a torch.nn class; sentence-transformers "
                              "would fall back to Tanh with a warning unless trust_remote_code: use it for this model")
    module_name, _, cls_name = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"{name} is not an nn.Module class")
        return cls()
    except (ImportError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{path}: activation_function {name!r} cannot be built ({e})") from None


def _read_weights(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if pt.is_file():  # what sentence-transformers does too: the restricted unpickler runs no code
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file or a pickle that holds more than tensors
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{folder}: the Dense weights cannot be read safely ({type(e).__name__}: {why}); "
                              "convert them to model.safetensors with sentence-transformers") from None
    raise CheckpointError(f"{folder} has neither model.safetensors nor pytorch_model.bin for its Dense module")


class DenseModule(nn.Module):
    """sentence vector -> activation(linear(x)) (+ x, or + residual(x), when use_residual), fp32."""

    TYPE = "Dense"

    def __init__(self, linear: nn.Linear, activation: nn.Module, residual: nn.Linear | None = None, use_residual=False):
        super().__init__()
        self.linear, self.activation, self.residual, self.use_residual = linear, activation, residual, use_residual

    def output_dim(self, d: int) -> int:
        return self.linear.out_features

    @classmethod
    def load(cls, folder: Path, d: int) -> "DenseModule":
        path = folder / "config.json"
        c = read_json(path, "Dense config")
        _unknown(c, {"in_features", "out_features", "bias", "activation_function", "module_input_name",
                     "module_output_name", "use_residual"}, path, "Dense")
        for key in ("in_features", "out_features"):
            if not isinstance(c.get(key), int) or isinstance(c.get(key), bool) or c[key] < 1:
                raise CheckpointError(f"{path}: {key} must be a positive integer; got {c.get(key)!r}")
        if c["in_features"] != d:
            raise CheckpointError(f"{path}: in_features {c['in_features']} is not the {d} features the module before gives")
        for key in ("module_input_name", "module_output_name"):
            if c.get(key, "sentence_embedding") not in ("sentence_embedding", None):
                raise CheckpointError(f"{path}: {key}={c[key]!r} (btlib's Dense acts on the sentence embedding only); "
                                      "use sentence-transformers for this model")
        bias, use_residual = _flag(c, "bias", True, path), _flag(c, "use_residual", False, path)
        act = _activation(c.get("activation_function", "torch.nn.modules.activation.Tanh"), path)
        n_in, n_out = c["in_features"], c["out_features"]
        module = cls(nn.Linear(n_in, n_out, bias=bias), act,
                     nn.Linear(n_in, n_out, bias=False) if use_residual and n_in != n_out else None, use_residual)
        sd = _read_weights(folder)
        want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        problems = [f"missing {k}" for k in want if k not in sd] + [f"unexpected {k}" for k in sd if k not in want]
        problems += [f"{k}: shape {tuple(sd[k].shape)}, config implies {s}" for k, s in want.items()
                     if k in sd and tuple(sd[k].shape) != s]
        if problems:
            raise CheckpointError(f"{folder}: the Dense weights do not match its config.json: " + "; ".join(problems))
        with torch.no_grad():
            module.load_state_dict({k: v.float() for k, v in sd.items()})
        return module.eval().requires_grad_(False)

    def forward(self, x: Tensor, *_) -> Tensor:
        """x (B, in_features) float32 -> (B, out_features) float32."""
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


class NormalizeModule(nn.Module):
    """L2-normalise the sentence vector (F.normalize, eps 1e-12, as sentence-transformers)."""

    TYPE = "Normalize"

    def output_dim(self, d: int) -> int:
        return d

    @classmethod
    def load(cls, folder: Path, d: int) -> "NormalizeModule":
        path = folder / "config.json"
        c = read_json(path, "Normalize config")
        _unknown(c, {"module_input_name", "module_output_name"}, path, "Normalize")
        for key in ("module_input_name", "module_output_name"):
            if c.get(key, "sentence_embedding") not in ("sentence_embedding", None):
                raise CheckpointError(f"{path}: {key}={c[key]!r} (btlib normalises the sentence embedding only); "
                                      "use sentence-transformers for this model")
        return cls()

    def forward(self, x: Tensor, *_) -> Tensor:
        return F.normalize(x, p=2, dim=-1)


MODULE_TYPES = {m.TYPE: m for m in (PoolingModule, DenseModule, NormalizeModule)}


class SentenceHead:
    """The modules after the Transformer, run in order on its packed token states (fp32, on the CPU).

    The first is a :class:`PoolingModule`; Dense and Normalize follow in any order. truncate_dim keeps the
    first features of the result (after Normalize, without renormalising: what sentence-transformers does).
    """

    def __init__(self, modules: list[nn.Module] | tuple[nn.Module, ...], truncate_dim: int | None = None):
        modules = tuple(modules)
        if not modules or not isinstance(modules[0], PoolingModule) or any(isinstance(m, PoolingModule) for m in modules[1:]):
            raise ValueError("a SentenceHead is one PoolingModule followed by DenseModule / NormalizeModule; got "
                             f"{[type(m).__name__ for m in modules]}")
        self.modules, self.truncate_dim = modules, truncate_dim

    def __repr__(self) -> str:
        inner = ", ".join(repr(m).replace("\n", " ") for m in self.modules)
        return f"SentenceHead({inner}" + (f", truncate_dim={self.truncate_dim})" if self.truncate_dim else ")")

    def output_dim(self, d: int) -> int:
        for m in self.modules:
            d = m.output_dim(d)
        return min(d, self.truncate_dim) if self.truncate_dim else d

    def without_normalize(self) -> "SentenceHead":
        """This head less its trailing Normalize modules: the vector a Normalize would have normalised (TEI's
        ``normalize=false``). ValueError where a Normalize is followed by another module (its output is not the
        unnormalised vector of anything)."""
        modules = list(self.modules)
        while isinstance(modules[-1], NormalizeModule):
            modules.pop()
        if any(isinstance(m, NormalizeModule) for m in modules):
            raise ValueError(f"this head normalises before its last module ({[type(m).__name__ for m in self.modules]}): "
                             "there is no unnormalised vector to give")
        return SentenceHead(modules, self.truncate_dim)

    def __call__(self, h: Tensor, cu_seqlens: Tensor, prompt_length: int | None = None) -> Tensor:
        """h (total, d) float32, cu_seqlens (B + 1,) -> (B, output_dim(d)) float32."""
        x = self.modules[0](h, cu_seqlens, prompt_length)
        for m in self.modules[1:]:
            x = m(x)
        return x[:, :self.truncate_dim] if self.truncate_dim else x


@dataclass(frozen=True)
class Pooling:
    """Shorthand for the common lists: [PoolingModule(mode)], then NormalizeModule when ``normalize``."""

    mode: str = "mean"          # one of POOLING_MODES, e.g. "mean" over real tokens or "cls" (the first token)
    normalize: bool = True      # L2-normalise the pooled vector


def as_head(pooling: Pooling | SentenceHead, d: int) -> SentenceHead:
    """A SentenceHead for a d-dimensional encoder from either form; TypeError for anything else."""
    if isinstance(pooling, SentenceHead):
        return pooling
    if isinstance(pooling, Pooling):
        return SentenceHead([PoolingModule(d, (pooling.mode,))] + ([NormalizeModule()] if pooling.normalize else []))
    raise TypeError(f"pooling must be a Pooling or a SentenceHead; got {type(pooling).__name__}")


class HasHead:
    """``model.pooling``: the model's SentenceHead (``model.head``) read and set as a :class:`Pooling` where one says it."""

    head: SentenceHead
    spec: object

    @property
    def pooling(self) -> Pooling | SentenceHead:
        """Pooling(mode, normalize) when the head is just that; otherwise the SentenceHead itself."""
        mods, first = self.head.modules, self.head.modules[0]
        rest = [type(m) for m in mods[1:]]
        if len(first.modes) == 1 and first.include_prompt and rest in ([], [NormalizeModule]) and not self.head.truncate_dim:
            return Pooling(first.modes[0], bool(rest))
        return self.head

    @pooling.setter
    def pooling(self, value: Pooling | SentenceHead) -> None:
        self.head = as_head(value, self.spec.d_model)
