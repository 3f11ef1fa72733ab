#!/usr/bin/env python3
"""A large plain-text corpus of documents for measuring the data loader:
paragraphs of data/corpus.txt drawn at random (seeded), 1-4 per document,
documents separated by a blank line, until SIZE bytes.

Usage: scripts/gen_big_corpus.py OUT [SIZE_BYTES] [SEED]
(the 2.1 GB measurement in the notes: SIZE 2100000000, SEED 7)
"""
import os
import random
import sys

out = sys.argv[1]
target = int(sys.argv[2]) if len(sys.argv) > 2 else 2_100_000_000
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 7
here = os.path.dirname(os.path.abspath(__file__))
text = open(os.path.join(here, "..", "data", "corpus.txt")).read()
paras = [p.strip() for p in text.split("\n\n") if p.strip()]
rng = random.Random(seed)
n = 0
with open(out, "w") as f:
    buf = []
    while n < target:
        doc = "\n".join(rng.choice(paras) for _ in range(rng.randint(1, 4)))
        buf.append(doc)
        n += len(doc) + 2
        if len(buf) >= 10000:
            f.write("\n\n".join(buf) + "\n\n")
            buf = []
    if buf:
        f.write("\n\n".join(buf) + "\n\n")
print(n)
