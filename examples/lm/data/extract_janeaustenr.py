"""Re-create persuasion.txt from Debian's r-cran-janeaustenr package (no R needed).

    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb pkg
    python extract_janeaustenr.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata > out.txt

The package stores each novel as an R character vector (one element per line) in R's lazy-load
database: Rdata.rdx (gzip'd index of offsets) and Rdata.rdb (per object: 4-byte length + zlib
stream of R's XDR serialization). This reads just enough of that format: strings, vectors, lists.
"""
import gzip
import struct
import sys
import zlib


class _Reader:
    def __init__(self, data):
        self.b, self.i, self.refs = data, 0, []

    def int(self):
        v = struct.unpack(">i", self.b[self.i:self.i + 4])[0]
        self.i += 4
        return v

    def header(self):
        assert self.b[:2] == b"X\n", "not an XDR serialization"
        self.i = 2
        version = self.int()
        self.int(), self.int()
        if version == 3:
            n = self.int()  # length of the native encoding name, then the name
            self.i += n

    def item(self):
        flags = self.int()
        typ, has_attr, has_tag = flags & 0xFF, flags & 0x200, flags & 0x400
        if typ == 254:                      # NILVALUE
            return None
        if typ == 9:                        # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.b[self.i:self.i + n].decode("utf-8")
            self.i += n
            return s
        if typ == 1:                        # SYMSXP: remember it for later references
            name = self.item()
            self.refs.append(name)
            return name
        if typ == 255:                      # REFSXP: an earlier symbol
            return self.refs[(flags >> 8) - 1]
        if typ == 2:                        # LISTSXP (pairlist)
            out = []
            while typ == 2:
                if has_attr:
                    self.item()
                if has_tag:
                    self.item()
                out.append(self.item())
                flags = self.int()
                typ, has_attr, has_tag = flags & 0xFF, flags & 0x200, flags & 0x400
            return out
        if typ in (10, 13, 14, 16, 19):     # lgl, int, real, str, list vectors
            n = self.int()
            if typ in (16, 19):
                v = [self.item() for _ in range(n)]
            else:
                w = 8 if typ == 14 else 4
                v = list(struct.unpack(">%d%s" % (n, "d" if typ == 14 else "i"),
                                       self.b[self.i:self.i + w * n]))
                self.i += w * n
            if has_attr:
                self.item()
            return v
        raise ValueError(f"unsupported R type {typ} at byte {self.i}")


def objects(prefix):
    r = _Reader(gzip.decompress(open(prefix + ".rdx", "rb").read()))
    r.header()
    offsets = r.item()[0]
    db = open(prefix + ".rdb", "rb").read()
    for off, length in offsets:
        chunk = db[off:off + length]
        raw = zlib.decompress(chunk[4:])
        assert len(raw) == struct.unpack(">I", chunk[:4])[0]
        obj = _Reader(raw)
        obj.header()
        yield obj.item()


if __name__ == "__main__":
    for lines in objects(sys.argv[1]):
        text = "\n".join(x or "" for x in lines) + "\n"
        if text.startswith("Persuasion"):
            sys.stdout.write(text)
