"""Per request, the time between consecutive trace points of one Serve call ingress -> pool
replica (app-trace.patch, ray-trace.patch): mean and p50 in ms over the requests that have
them all, the first five dropped as warm-up. Usage: python analyze.py TRACE"""

import statistics
import sys

POINTS = {
    "P0": "the ingress is about to dispatch (after sent_at and its own bookkeeping)",
    "P1": "handle.generate.remote() called",
    "P2": "remote() returned",
    "R1": "Serve's router sends it (gRPC wrapper: send_request_python)",
    "R2": "request serialized, gRPC call object made",
    "S1": "the replica's gRPC handler started (HandleRequestWithRejectionStreaming)",
    "S2": "Serve's replica accepted it (rejection check, request wrapping)",
    "S3": "initial metadata sent, the user generator is called",
    "G": "the app's generate() got it (its `received`)",
}
ORDER = list(POINTS)

requests: list[dict[str, float]] = []
for line in open(sys.argv[1]):
    label, at, *method = line.split()
    if label == "P0":
        requests.append({"P0": float(at)})
    elif requests and label not in requests[-1]:
        if label in ("R1", "R2") and method != ["generate"]:
            continue  # the board's reports and exchanges, the channel calls
        requests[-1][label] = float(at)
complete = [r for r in requests if all(p in r for p in ORDER)][5:]
print(f"{len(complete)} requests")
for a, b in zip(ORDER, ORDER[1:]):
    ms = [(r[b] - r[a]) * 1e3 for r in complete]
    print(f"{a}->{b}  mean {statistics.mean(ms):6.3f}  p50 {statistics.median(ms):6.3f}  "
          f"({POINTS[b]})")
ms = [(r["G"] - r["P0"]) * 1e3 for r in complete]
print(f"P0->G   mean {statistics.mean(ms):6.3f}  p50 {statistics.median(ms):6.3f}  (the whole hop)")
