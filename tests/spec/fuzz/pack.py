"""A fuzz corpus as one file for replay_main.cc: each input as
"<decimal byte count>\\n<bytes>\\n", in file-name order.
Usage: python3 tests/spec/fuzz/pack.py CORPUS_DIR OUT.packed       (pack a merged corpus)
       python3 tests/spec/fuzz/pack.py --unpack IN.packed OUT_DIR  (seeds for libFuzzer)"""
import hashlib
import os
import sys

if sys.argv[1] == "--unpack":
    data = open(sys.argv[2], "rb").read()
    os.makedirs(sys.argv[3], exist_ok=True)
    pos = 0
    while pos < len(data):
        nl = data.index(b"\n", pos)
        n = int(data[pos:nl])
        item = data[nl + 1:nl + 1 + n]
        with open(os.path.join(sys.argv[3], hashlib.sha1(item).hexdigest()), "wb") as f:
            f.write(item)
        pos = nl + 1 + n + 1
else:
    src, out = sys.argv[1], sys.argv[2]
    with open(out, "wb") as f:
        for name in sorted(os.listdir(src)):
            with open(os.path.join(src, name), "rb") as g:
                item = g.read()
            f.write(b"%d\n" % len(item) + item + b"\n")
