#!/bin/sh
# bench.quick_run: `tshare-bench --quick` runs every row and writes them all.
# Checks the output's shape and that what was measured is a real figure, not
# the figures themselves (timings are never asserted in tests).
set -eu
bench=$1
out=$2
command -v python3 >/dev/null 2>&1 || { echo "python3 is needed to read bench.json"; exit 77; }
rm -rf "$out"
"$bench" --quick --out "$out"
exec python3 - "$out" <<'PY'
import csv, json, math, sys
out = sys.argv[1]
doc = json.load(open(f"{out}/bench.json"))
rows = {r["key"]: r for r in doc["rows"]}
def fail(msg):
    print("FAILED:", msg); sys.exit(1)
def measured(key):
    r = rows.get(key) or fail(f"row {key} missing")
    if r["skipped"]: fail(f"row {key} skipped: {r['skipped']}")
    if r["value"] is None or not math.isfinite(r["value"]): fail(f"row {key} has no figure")
    return r
for key in ["floor", "floor_fd", "host_reused", "floor_socket", "floor_fd_socket", "host_reused_socket",
            "floor_ring_nospin", "host_reused_ring_nospin"]:
    r = measured(key)
    if not 0 < r["value"] <= r["p99"]: fail(f"{key}: p50 {r['value']} p99 {r['p99']}")
    if r["n"] != 500: fail(f"{key}: {r['n']} samples, not 500")
if rows["host_reused"]["vs_floor"] is None: fail("host_reused has no ratio to its floor")
for key in ["idle_consumer_cpu", "idle_consumer_cpu_socket", "idle_consumer_cpu_ring_nospin"]:
    if not 0 <= measured(key)["value"] <= 200: fail(f"{key} is not a share of a core")
for key in ["host_pipelined_1", "host_pipelined_4", "host_pipelined_1_socket"]:
    if measured(key)["value"] <= 0: fail(f"{key} is not a rate")
mem = [r for r in doc["rows"] if r["group"] == "memory" and r["key"].startswith("host_")]
if len(mem) != 5 or any(r["skipped"] or r["before"] is None for r in mem): fail(f"host memory rows: {mem}")
gpu = not doc["device"].startswith(("no GPU", "built without"))
for key in ["cuda_new_alloc", "cuda_pipelined_1", "bw_shared", "drv_event_record"]:
    r = rows.get(key) or fail(f"row {key} missing")
    if gpu: measured(key)
    elif not r["skipped"]: fail(f"{key} measured without a GPU?")
if gpu:  # the profile of (b) and (c): a figure per phase, with the driver calls behind it
    for kind in ["reused", "slab"]:
        for phase in ["share", "import", "release"]:
            r = measured(f"own_{kind}_{phase}")
            if "driver" not in r["note"]: fail(f"own_{kind}_{phase} does not say its driver time: {r['note']}")
for key in ["torch_mp_cuda", "torch_mp_cpu", "torch_bridge_cuda", "torch_bridge_cpu"]:
    r = rows.get(key) or fail(f"row {key} missing")
    if not r["skipped"]: measured(key)
for scene in ["pinned", "busy"]:  # both ends on one CPU; a busy loop on every CPU
    for transport in ["ring", "socket"]:
        for row in ["floor", "floor_fd", "host_reused"]:
            r = measured(f"{row}_{scene}_{transport}")
            if not 0 < r["value"] <= r["p99"]: fail(f"{r['key']}: p50 {r['value']} p99 {r['p99']}")
# A model's state_dict: every impl, device, mode and consumer count has its
# row; CPU ones measured wherever the program could run (torch present),
# CUDA ones skipped without a GPU, and a measured set row has its torch.mp ratio.
for dev in ["cpu", "cuda"]:
    for impl, counts in [("bridge", [1, 4]), ("bridge_packed", [1]), ("bridge_into", [1]), ("bridge_packed_into", [1]),
                         ("bridge_rebuilt", [1]), ("bridge_loop", [1]),
                         ("python", [1, 4]), ("python_packed", [1]), ("python_into", [1]), ("python_packed_into", [1]),
                         ("python_loop", [1]), ("torch_mp", [1, 4])]:
        for mode in ["first", "update"]:
            for n in counts:
                key = f"sets_{impl}_{dev}_{mode}_{n}"
                r = rows.get(key) or fail(f"row {key} missing")
                if r["group"] != "sets": fail(f"{key} is in group {r['group']}")
                if dev == "cuda" and not gpu and not r["skipped"]: fail(f"{key} measured without a GPU?")
                if not r["skipped"]:
                    measured(key)
                    if not 0 < r["value"] <= r["p99"]: fail(f"{key}: p50 {r['value']} p99 {r['p99']}")
                    if "tensors" not in r["note"]: fail(f"{key} does not say what it sent: {r['note']}")
                    mp = rows[f"sets_torch_mp_{dev}_{mode}_{n}"]
                    if impl in ("bridge", "python") and not mp["skipped"] and r["peer_over_this"] is None:
                        fail(f"{key} has no ratio to torch.mp")
if not any(r["key"].startswith("sets_") and not r["skipped"] for r in doc["rows"]) and \
        not rows["torch_bridge_cpu"]["skipped"]:
    fail("the bridge ran, but no state_dict row was measured")
for key in ["ucx_share_4k", "ucx_share_64m", "ucx_same_host_native"]:  # measured, or skipped with the reason
    r = rows.get(key) or fail(f"row {key} missing")
    if not r["skipped"]: measured(key)
if not rows["ucx_same_host_native"]["skipped"] and "ucx]" in rows["ucx_same_host_native"]["label"]:
    fail("a same-host channel by name went over UCX")
if len(doc["targets"]) != 26: fail("targets missing")
for start in ("sets: repeated update >= 100x", "sets: first hand-off of a packed module",
              "sets: repeated update, a consumer receiving into", "sets: repeated update of a packed module"):
    if not any(t["target"].startswith(start) for t in doc["targets"]): fail(f"target '{start}...' missing")
with open(f"{out}/bench.csv") as f:
    lines = list(csv.DictReader(f))
if len(lines) != len(doc["rows"]): fail("the CSV and the JSON disagree")
print(f"bench.quick_run: {len(doc['rows'])} rows, device: {doc['device']}")
PY
