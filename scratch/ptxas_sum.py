import re, sys
cur = None
spill = "?"
names = ["maps", "tk", "pairs", "bias", "pv16", "ovl"]
for line in sys.stdin:
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
        n = m.group(1)
        mm = re.search(r'1wgILi(\d+)ELi(\d)E((?:Lb[01]E)*)', n)
        if mm:
            bools = re.findall(r'Lb([01])E', mm.group(3))
            cur = f"D{mm.group(1)} ctas{mm.group(2)} " + " ".join(f"{k}{v}" for k, v in zip(names, bools))
        else:
            cur = n[-40:]
        continue
    m = re.search(r'(\d+) bytes spill stores', line)
    if m: spill = m.group(1)
    m = re.search(r'Used (\d+) registers', line)
    if m and cur: print(f"{cur:44s} regs {m.group(1):>4} spill {spill}"); cur=None
