"""JinaBERT folders are refused, saying why: its network is remote code (jinaai/jina-bert-implementation) with no class
in transformers 5.23 (which has jina_embeddings_v3, an XLM-R with RoPE, not JinaBERT), so there is no reference here
to check a btlib version against. The config below is jina-embeddings-v2's form (model_type "bert", ALiBi, GeGLU),
shrunk; the refusal comes from config.json alone, before any weight is read."""

import json

import pytest

from btlib import load_pretrained
from btlib.pretrained import CheckpointError

TESTED_HERE = ["btlib.pretrained.folders.checkpoint"]

JINA_V2 = {"architectures": ["JinaBertForMaskedLM"], "attn_implementation": "torch",
           "auto_map": {"AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
                        "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"},
           "emb_pooler": "mean", "feed_forward_type": "geglu", "hidden_act": "gelu", "hidden_size": 32,
           "intermediate_size": 64, "layer_norm_eps": 1e-12, "max_position_embeddings": 8192, "model_type": "bert",
           "num_attention_heads": 4, "num_hidden_layers": 2, "pad_token_id": 0, "position_embedding_type": "alibi",
           "type_vocab_size": 2, "vocab_size": 64}


@pytest.mark.parametrize("changes, named", [
    ({}, "architectures ['JinaBertForMaskedLM']"),
    ({"architectures": None}, "auto_map ['jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig'"),
    ({"architectures": None, "auto_map": None, "model_type": "jina_bert"}, "model_type 'jina_bert'"),
])
def test_a_jina_bert_folder_is_refused_saying_why(tmp_path, changes, named):
    cfg = {k: v for k, v in {**JINA_V2, **changes}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="is a JinaBERT model") as e:
        load_pretrained(tmp_path)
    assert named in str(e.value) and "remote code" in str(e.value) and "no reference" in str(e.value)
    assert "trust_remote_code=True" in str(e.value)
