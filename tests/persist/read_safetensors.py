#!/usr/bin/env python3
"""An independent safetensors reader (standard library only), following the format's
specification, to show that files kvsnap writes open in other tools: 8-byte little-endian
header length, a JSON header of {name: {dtype, shape, data_offsets}} plus "__metadata__" (a map
of strings), then the data, fully indexed without holes or overlaps."""
import json
import struct
import sys

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "F64": 8, "I64": 8, "U8": 1}


def read(path):
    data = open(path, "rb").read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    metadata = header.pop("__metadata__", {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), "metadata"
    spans = []
    for name, info in header.items():
        count = 1
        for extent in info["shape"]:
            count *= extent
        begin, end = info["data_offsets"]
        assert end - begin == count * SIZES[info["dtype"]], name
        spans.append((begin, end, name))
    spans.sort()
    covered = 0
    for begin, end, name in spans:
        assert begin == covered, f"hole or overlap at {name}"
        covered = end
    assert covered == len(body), "trailing bytes"
    return header, metadata, body


def main():
    header, metadata, body = read(sys.argv[1])
    keys = header["layer.0.keys"]
    begin, _ = keys["data_offsets"]
    # bf16 -> float: the upper half of an IEEE binary32.
    first = struct.unpack("<f", b"\x00\x00" + body[begin:begin + 2])[0]
    print(f"{len(header)} tensors, metadata {sorted(metadata)}, layer.0.keys {keys['shape']} "
          f"{keys['dtype']} first value {first}")
    assert metadata["format"] == "kvsnap-snapshots"
    assert keys["dtype"] == "BF16"


if __name__ == "__main__":
    main()
