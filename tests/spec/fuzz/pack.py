"""Packs a fuzz corpus directory into one .packed file for replay_main.cc:
each input as "<decimal byte count>\\n<bytes>\\n", in file-name order.
Usage: python3 tests/spec/fuzz/pack.py CORPUS_DIR OUT.packed"""
import os
import sys

src, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as f:
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as g:
            data = g.read()
        f.write(b"%d\n" % len(data) + data + b"\n")
