#!/usr/bin/env python3
"""The N longest Rust functions under a directory (a brace matcher: fn line to its closing brace).

Usage: scripts/longest_fns.py src [N]
"""
import os
import re
import sys
root=sys.argv[1]; n=int(sys.argv[2]) if len(sys.argv)>2 else 10
pat=re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)')
res=[]
for d,_,fs in os.walk(root):
    if 'target' in d or '/tests' in d[len(root):] : pass
    for f in fs:
        if not f.endswith('.rs'): continue
        p=os.path.join(d,f)
        if '/target/' in p or '/fuzz/' in p: continue
        L=open(p).read().split('\n')
        in_test=False
        for i,l in enumerate(L):
            m=pat.match(l)
            if not m: continue
            # find opening brace and match
            depth=0; started=False; j=i
            while j<len(L):
                s=re.sub(r'"(\\.|[^"\\])*"','""',L[j]); s=re.sub(r'//.*','',s)
                s=re.sub(r"'(\\.|[^'\\])'","''",s)
                for c in s:
                    if c=='{': depth+=1; started=True
                    elif c=='}': depth-=1
                if started and depth<=0: break
                if not started and s.rstrip().endswith(';'): break
                j+=1
            if started: res.append((j-i+1,p[len(root)+1:],i+1,m.group(6)))
res.sort(reverse=True)
for r in res[:n]: print(f"{r[0]:5d}  {r[1]}:{r[2]}  {r[3]}")
