"""Reading a model folder: config.json and its checks, model.safetensors, a sentence-transformers folder's
modules.json, tokenizer and prompts. Nothing here builds a network (btlib.pretrained.architectures does).
"""
