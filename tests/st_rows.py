"""What sentence-transformers gives for btlib.serve's newer answers, for tests/serve_oracle.py: a chunked text's row
built by hand from the rules of btlib/pretrained/chunking.py's docstring, token states (/embed_all), SPLADE weights
(/embed_sparse). No btlib code: the chunks are cut here, the rows are sentence-transformers' modules run on them.

Chunks, for a folder whose tokenizer puts [CLS] before a text and [SEP] after it (tests/st_folders.py's):

    prompt  = the prompt's ids (without special tokens); content = ids of prompt + text with the prompt's removed
    window  = max_seq_length - 2 - len(prompt); overlap: the request's, else window // 8; step = window - overlap
    spans   = [0, window), [step, step + window), ...; the last one stops at len(content)
    chunk   = [CLS] + prompt + content[a:b] + [SEP]
    row     = sum(len(chunk) * pre(chunk)) / sum(len(chunk)), then the folder's Normalize

pre(chunk) is the folder's modules on the chunk's ids with its Normalize modules left out (the rows before the
Normalize that chunking pools; a Pooling of include_prompt false leaves [CLS] and the prompt out of each chunk, as
encode's prompt_length does); the weight of a chunk is its tokens, special and prompt tokens included (what ran). A
text within max_seq_length (content <= window) is one chunk whose ids are sentence-transformers' own for prompt + text.

    chunk_ids(t, "w1 " * 20, None, None)   # max_seq_length 12, prompt "w1 w2 ": window 8, overlap 1, 3 chunks
"""

from __future__ import annotations

import torch


def prompt_and_content(t, text: str, name: str | None) -> tuple[list[int], list[int]]:
    """(the prompt's ids, the text's content ids) by sentence-transformers' tokenizer, no special tokens."""
    tok, prompt = t.ref.tokenizer, t.prompt(name)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    ids = tok(prompt + text, add_special_tokens=False)["input_ids"]
    assert ids[:len(p_ids)] == p_ids, f"the prompt {prompt!r} tokenizes otherwise before {text[:40]!r}"
    return p_ids, ids[len(p_ids):]


def window(t, name: str | None) -> int:
    """Content tokens per chunk with prompt ``name`` (its default where None)."""
    prompt = t.prompt(name)
    return t.max_len - 2 - (len(t.ref.tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0)


def spans(n: int, w: int, overlap: int) -> list[tuple[int, int]]:
    """[a, b) windows of ``w`` over n tokens, each ``w - overlap`` after the previous, the last stopping at n."""
    out, a = [], 0
    while True:
        out.append((a, min(a + w, n)))
        if a + w >= n:
            return out
        a += w - overlap


def chunk_ids(t, text: str, name: str | None, overlap: int | None) -> list[list[int]]:
    """The id sequences a text runs as under long_inputs="chunk" (one, if it fits)."""
    tok = t.ref.tokenizer
    p_ids, content = prompt_and_content(t, text, name)
    w = window(t, name)
    cut = spans(len(content), w, w // 8 if overlap is None else overlap) if len(content) > w else [(0, len(content))]
    return [[tok.cls_token_id, *p_ids, *content[a:b], tok.sep_token_id] for a, b in cut]


def run_modules(t, ids: list[int], skip_normalize: bool = False, prompt_length: int | None = None) -> dict:
    """The folder's modules (its Normalize ones left out where ``skip_normalize``) on one id sequence: the features.
    prompt_length: [CLS] and the prompt's tokens, which a Pooling of include_prompt false leaves out (as encode sets it)."""
    features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if prompt_length:
        features["prompt_length"] = prompt_length
    with torch.no_grad():
        for module in t.ref:
            if not (skip_normalize and type(module).__name__ == "Normalize"):
                features = module(features)
    return features


def chunked_row(t, text: str, name: str | None, overlap: int | None, skip_normalize: bool) -> torch.Tensor:
    """(d,) the text's row under long_inputs="chunk": its chunks' rows before the Normalize, weighted by their tokens,
    then the Normalize (unless ``skip_normalize``: TEI's normalize=false)."""
    seqs = chunk_ids(t, text, name, overlap)
    p_ids, _ = prompt_and_content(t, text, name)
    prompt_length = 1 + len(p_ids) if p_ids else None
    rows = torch.stack([run_modules(t, s, True, prompt_length)["sentence_embedding"][0] for s in seqs])  # (C, d)
    w = torch.tensor([float(len(s)) for s in seqs])  # (C,)
    row = (rows * w[:, None]).sum(0) / w.sum()
    return row if skip_normalize or not t.normalizes else torch.nn.functional.normalize(row, dim=-1)


def token_states(t, inputs, name: str | None, id_rows) -> list[torch.Tensor]:
    """Each input's (L, hidden) token states: SentenceTransformer.encode(output_value="token_embeddings") of prompt +
    text (cut at max_seq_length), or the Transformer module on token ids as given (cut there)."""
    if id_rows is None:
        return t.ref.encode(inputs, prompt_name=name, output_value="token_embeddings")
    return [run_modules(t, ids[:t.max_len])["token_embeddings"][0] for ids in id_rows]


def sparse_rows(t, inputs, name: str | None, id_rows) -> torch.Tensor:
    """(N, vocab) SparseEncoder.encode's weights, dense (token ids: its modules on them as given, cut at max length)."""
    if id_rows is None:
        return t.ref.encode(inputs, prompt_name=name, convert_to_tensor=True).to_dense().float()
    return torch.stack([run_modules(t, ids[:t.max_len])["sentence_embedding"][0] for ids in id_rows]).float()
