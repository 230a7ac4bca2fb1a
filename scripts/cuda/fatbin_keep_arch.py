"""List or blank the CUDA fatbin entries of a shared object, by GPU architecture.

Device-check prep only (scripts/cuda/README.md): fbgemm-gpu's CUDA wheel (465 MB) holds cubins
for sm_80, sm_90 and sm_100; blanking the ones a machine does not run (zeroing their payloads,
headers kept, so the file keeps its layout) lets it compress to 75 MB.

  python3 fatbin_keep_arch.py LIB.so list
  python3 fatbin_keep_arch.py LIB.so keep=90 OUT.so
"""
import collections
import struct
import sys
MAGIC = struct.pack("<I", 0xBA55ED50)

def entries(buf):
    pos = 0
    while True:
        i = buf.find(MAGIC, pos)
        if i < 0:
            return
        magic, ver, hsize, fsize = struct.unpack_from("<IHHQ", buf, i)
        if ver != 1 or hsize != 16:
            pos = i + 4; continue
        e = i + hsize; end = e + fsize
        while e < end:
            kind, _u, ehs, size = struct.unpack_from("<HHIQ", buf, e)
            minor, major, arch = struct.unpack_from("<HHI", buf, e + 24)
            flags, = struct.unpack_from("<Q", buf, e + 44) if ehs >= 52 else (0,)
            yield dict(at=e, kind=kind, hsize=ehs, size=size, arch=arch, flags=flags)
            if ehs == 0: break
            e += ehs + size
        pos = end

def main():
    path, mode = sys.argv[1], sys.argv[2]
    buf = bytearray(open(path, "rb").read())
    hist = collections.Counter(); n = collections.Counter()
    for en in entries(buf):
        key = (en["kind"], en["arch"])
        hist[key] += en["size"]; n[key] += 1
        if mode.startswith("keep="):
            keep = {int(a) for a in mode[5:].split(",")}
            if en["arch"] not in keep:
                s = en["at"] + en["hsize"]
                buf[s:s + en["size"]] = bytes(en["size"])
    for k in sorted(hist):
        print(path.split("/")[-1], "kind", k[0], "sm", k[1], "entries", n[k], "MiB %.1f" % (hist[k] / 2**20))
    if mode.startswith("keep="):
        open(sys.argv[3], "wb").write(buf)
main()
