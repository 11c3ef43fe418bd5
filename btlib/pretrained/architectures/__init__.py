"""The encoder networks btlib loads, one module per family (and the cross-encoder head), each with its loader.
They read folders through btlib.pretrained.folders and encode through btlib.pretrained.encoding's one loop.
"""
