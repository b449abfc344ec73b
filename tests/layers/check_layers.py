#!/usr/bin/env python3
"""Checks kvsnap's one direction of dependency on every source file under ROOT.

Layers, lowest first: a file may include the public headers (include/kvsnap/) of its own layer
and of lower ones, the private headers of its own folder, and the internal interface headers a
lower layer lists in INTERFACES. Anything else — a higher layer, or another layer's private
header — is reported, and the exit status is 1.

    check_layers.py ROOT
"""
import pathlib
import re
import sys

# (layer, its source folders, its public headers), lowest first.
LAYERS = [
    ("array", ["src/array"], ["allocator.h", "array.h", "dtype.h", "error.h", "export.h", "shape.h"]),
    ("attention", ["src/attention"], ["attention.h", "batch.h"]),
    ("ops", ["src/ops"], ["ops.h"]),
    ("cache", ["src/cache"], ["cache.h", "kv_cache.h", "paged_kv_cache.h", "rotating_kv_cache.h",
                            "recurrent_cache.h", "speculation.h"]),
    ("persist", ["src/persist"], ["persistence.h"]),
    ("tier", ["src/tier"], ["tier.h"]),
    ("prefix", ["src/prefix"], ["prefix_cache.h"]),
    # kvsnap.h, the umbrella, includes every public C++ header: dlpack.h's too.
    ("capi", ["src/capi"], ["kvsnap_c.h", "kvsnap_c_files.h", "kvsnap_c_speculation.h",
                          "kvsnap_c_tier.h", "dlpack.h", "kvsnap.h"]),
    ("python", ["python"], []),
    ("tools", ["src/model", "tools", "bench"], []),
]
# Private headers a layer offers the layers above it (the rest of its folder is its own).
INTERFACES = {
    "array": ["array/streaming.h", "array/f32_in_order.h"],
    "attention": ["attention/paged_gather.h", "attention/recycler.h", "attention/row_batch.h"],
    "ops": ["ops/vector_isa.h", "ops/parallel.h", "ops/activations.h", "ops/kernel_report.h",
            "ops/decode_kernels.h"],
    "cache": ["cache/snapshot_record.h", "cache/state_snapshot.h", "cache/cache_access.h"],
    "persist": ["persist/files.h", "persist/safetensors.h", "persist/record_tensors.h"],
}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def rank(layer):
    return [name for name, _, _ in LAYERS].index(layer)


def public_layer(header):
    for name, _, headers in LAYERS:
        if header in headers:
            return name
    return None


def folder_layer(folder):
    for name, folders, _ in LAYERS:
        if folder in folders:
            return name
    return None


def check(root):
    problems = []
    files = []
    for name, folders, headers in LAYERS:
        for folder in folders:
            for path in sorted((root / folder).rglob("*")):
                if path.suffix in (".h", ".cc"):
                    files.append((path, name, folder))
        for header in headers:
            path = root / "include" / "kvsnap" / header
            if path.exists():
                files.append((path, name, None))
    for path, layer, own_folder in files:
        for included in INCLUDE.findall(path.read_text(errors="replace")):
            where = f"{path.relative_to(root)}: #include {included}"
            if included.startswith("kvsnap/"):
                target = public_layer(included[len("kvsnap/"):])
                if target is None:
                    problems.append(f"{where}: not a public header of any layer")
                elif rank(target) > rank(layer):
                    problems.append(f"{where}: layer {layer} includes higher layer {target}")
                continue
            if "/" not in included:
                continue  # a system header, or one beside the file
            folder = "src/" + included.split("/")[0]
            target = folder_layer(folder)
            if target is None or folder == own_folder:
                continue  # a third-party header, or the folder's own private one
            if rank(target) > rank(layer):
                problems.append(f"{where}: layer {layer} includes higher layer {target}")
            elif included not in INTERFACES.get(target, []) and target != layer:
                problems.append(f"{where}: a private header of layer {target}")
    return problems


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = check(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} include(s) break the direction of dependency")
        return 1
    print("layers: every include follows the direction of dependency")
    return 0


if __name__ == "__main__":
    sys.exit(main())
