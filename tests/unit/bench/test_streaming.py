import argparse
from pathlib import Path
from typing import Any

import pytest

from serve_app.bench import servers, streaming

ROOT = Path(__file__).resolve().parents[3]


CLIENT = streaming.Client(None, "m", "t")  # type: ignore[arg-type]  # never runs here


def row(target: str, tok_s: float, ttft: float, repeat: int, itl: float = 5.0) -> dict[str, object]:
    """One `vllm bench serve` result as the bench records it (concurrency 4)."""
    return {
        "target": target,
        "concurrency": 4,
        "repeat": repeat,
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "median_itl_ms": itl,
        "median_tpot_ms": itl,
        "mean_itl_ms": itl,
        "completed": 16,
        "duration": 20.0,
        "outside_ms": 7.0,
    }


def test_summary_pairs_runs_by_repeat_and_takes_ratios() -> None:
    rows = [row("vllm serve", 100, 10, 0), row("app", 90, 13, 0, itl=10)]
    rows += [row("app", 100, 12, 1, itl=10), row("vllm serve", 100, 10, 1)]
    (s,) = streaming.summarize(rows)
    app = s["targets"]["app"]
    assert s["best_vllm"] == "vllm serve" and app["runs"] == 2
    assert app["vs_best_vllm"]["tok_s_ratio"] == {"mean": 0.95, "min": 0.9, "max": 1.0}
    assert app["vs_best_vllm"]["ttft_p50_delta_ms"] == {"mean": 2.5, "min": 2.0, "max": 3.0}
    assert app["vs_best_vllm"]["itl_p50_ratio"]["mean"] == 2.0
    text = streaming.table([s])
    assert "| 4 | app | 2 × 16 | 95 (90–100) | 12.5 (12.0–13.0) | 10.0 | 10.0 | 7.0 |" in text
    assert "| 0.950 (0.900–1.000) | +2.5 (+2.0–+3.0) | 2.00 |" in text


def test_a_repeat_under_way_pairs_only_what_both_ran() -> None:
    # written after every run: repeat 1 has the app's run and not yet vllm serve's
    rows = [row("vllm serve", 100, 10, 0), row("app", 90, 13, 0), row("app", 50, 12, 1)]
    (s,) = streaming.summarize(rows)
    assert s["targets"]["app"]["runs"] == 2
    assert s["targets"]["app"]["vs_best_vllm"]["tok_s_ratio"]["max"] == 0.9
    (alone,) = streaming.summarize([row("app", 90, 13, 0)])  # no vllm serve run yet
    assert alone["best_vllm"] is None and "vs_best_vllm" not in alone["targets"]["app"]
    assert "| 4 | app | 1 × 16 | 90 |" in streaming.table([alone])


def test_time_outside_latency_is_a_slots_time_per_request_less_its_latency() -> None:
    # 4 slots for 2 s carried 10 requests: 800 ms each, of which 600 ms request to last token
    r = {"duration": 2.0, "completed": 10, "mean_e2el_ms": 600.0}
    assert streaming.outside_latency_ms(r, 4) == pytest.approx(200.0)


def test_the_app_is_compared_with_the_best_vllm_serve_of_each_repeat() -> None:
    rows = [row("vllm serve x1", 80, 10, r) for r in (0, 1)]
    rows += [row("vllm serve x4", v, 10, r) for r, v in ((0, 100), (1, 120))]
    rows += [row("app", v, 11, r) for r, v in ((0, 100), (1, 108))]
    (s,) = streaming.summarize(rows)
    assert s["best_vllm"] == "vllm serve x4"
    ratio = s["targets"]["app"]["vs_best_vllm"]["tok_s_ratio"]
    assert (ratio["min"], ratio["max"]) == (0.9, 1.0)
    assert "vllm serve x1" in s["targets"] and "vs_best_vllm" not in s["targets"]["vllm serve x1"]
    assert "| 4 | vllm serve x4 (best) |" in streaming.table([s])


def test_one_vllm_serve_per_api_server_count() -> None:
    assert servers.vllm_variants(["--x"], []) == [("vllm serve", ["--x"])]
    named = servers.vllm_variants([], [1, 4])
    assert named == [
        ("vllm serve x1", ["--api-server-count=1"]),
        ("vllm serve x4", ["--api-server-count=4"]),
    ]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [row("vllm serve", 100, 10, r) for r in (0, 1)] + [row("app", 90, 12, 0)]
    streaming.plot(streaming.summarize(rows), tmp_path / "s.png", "t")
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_are_sized_to_last_the_minimum_against_the_fastest_server(monkeypatch) -> None:
    rates = {"vllm serve x1": 2.0, "vllm serve x4": 5.0, "app": 4.0}  # requests/s
    piloted: list[tuple[str, int]] = []
    seeds: set[int] = set()

    def pilot(server, client, args, conc, out, prompts, seed):  # type: ignore[no-untyped-def]
        piloted.append((server.name, prompts))
        seeds.add(seed)
        return {"completed": prompts, "duration": prompts / rates[server.name]}

    monkeypatch.setattr(streaming, "bench_once", pilot)
    targets = [servers.Server(name, "http://127.0.0.1:1", None) for name in rates]  # type: ignore[arg-type]
    args = argparse.Namespace(
        num_prompts=0, min_cell_s=20.0, out=Path("."), requests_per_run={}, seed=0
    )
    assert streaming.cell_prompts(targets, CLIENT, args, conc=8) == 110  # 5 req/s x 20 s x 1.1
    assert piloted == [(name, 32) for name in rates]  # each server once, 4 x concurrency
    assert len(seeds) == 1  # the same prompts for every server
    args.min_cell_s = 0
    assert streaming.cell_prompts(targets, CLIENT, args, conc=64) == 256  # 4 x concurrency


def test_no_run_repeats_the_prompts_of_another() -> None:
    """Every run draws its own prompts: a server would answer a repeated prompt from its prefix
    cache. The warm-up, the pilots and every repeat at every concurrency, for two base seeds."""
    for base in (0, 7):
        runs = [base] + [
            streaming.run_seed(base, conc, rep)
            for conc in (1, 4, 64, 256)
            for rep in (None, *range(5))
        ]
        runs += [
            streaming.run_seed(base, conc, rep, again=True) for conc in (1, 64) for rep in range(5)
        ]
        assert len(set(runs)) == len(runs)


def test_a_run_that_came_out_short_is_made_again_with_prompts_of_its_own(monkeypatch) -> None:
    """Sized from a pilot, a run against a server that has sped up since comes out under
    --min-cell-s: it is made again, sized from its own rate."""
    runs: list[tuple[int, int]] = []

    def run(server, client, args, conc, out, prompts, seed):  # type: ignore[no-untyped-def]
        runs.append((prompts, seed))
        return {"completed": prompts, "duration": prompts / 10.0}  # 10 requests/s

    monkeypatch.setattr(streaming, "bench_once", run)
    server = servers.Server("app", "http://127.0.0.1:1", None)  # type: ignore[arg-type]
    args = argparse.Namespace(min_cell_s=20.0, out=Path("."), seed=0)
    row, prompts, short = streaming.long_enough_run(server, CLIENT, args, 4, 150, repeat=1)
    assert short == {"completed": 150, "duration": 15.0}
    assert prompts == 220 and row == {"completed": 220, "duration": 22.0}  # 10/s x 20 s x 1.1
    assert [p for p, _ in runs] == [150, 220] and runs[0][1] != runs[1][1]
    runs.clear()
    row, prompts, short = streaming.long_enough_run(server, CLIENT, args, 4, 200, repeat=1)
    assert short is None and prompts == 200 and len(runs) == 1


def test_runs_sized_on_the_command_line_need_no_pilots(monkeypatch) -> None:
    monkeypatch.setattr(streaming, "bench_once", lambda *a, **k: pytest.fail("piloted"))
    args = argparse.Namespace(
        num_prompts=0, min_cell_s=20.0, out=Path("."), requests_per_run={64: 900, 256: 100}
    )
    assert streaming.cell_prompts([], CLIENT, args, conc=64) == 900
    assert streaming.cell_prompts([], CLIENT, args, conc=256) == 1024  # at least 4 x conc
    assert streaming.conc_counts("64=900,256=100") == {64: 900, 256: 100}


def _title(proc: Any) -> str:
    """argv[0] of a child, or "" while it has none yet (just forked) or is gone."""
    import psutil

    try:
        return str((proc.cmdline() or [""])[0])
    except psutil.Error:
        return ""


@pytest.mark.parametrize("native", [False, True])
def test_py_spy_samples_the_pool_and_ingress_replicas_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    import os
    import signal
    import subprocess
    import time

    import psutil

    fake = tmp_path / "py-spy"
    fake.write_text('#!/bin/sh\necho "$@"\n')  # its log then holds the arguments it was given
    fake.chmod(0o755)
    monkeypatch.setenv("PY_SPY", str(fake))
    titles = ("ServeReplica:llm:pool-low-latency", "ServeReplica:llm:Ingress", "raylet")
    # A tree of its own (this process may have other children, e.g. Ray's workers): a shell
    # whose three children run under those titles, as the app's processes would.
    script = " ".join(f"(exec -a '{t}' sleep 30) &" for t in titles) + " wait"
    root = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        # Until each child has exec'd under its title: a child not yet exec'd is a fork of the
        # shell, whose command line holds every title, so match on argv[0] alone.
        for _ in range(100):
            by_title = {_title(c): c.pid for c in psutil.Process(root.pid).children()}
            if set(titles) <= by_title.keys():
                break
            time.sleep(0.05)
        pool, ingress = by_title[titles[0]], by_title[titles[1]]
        spies = streaming.start_py_spy(root.pid, 5, tmp_path, "c64", native)
        for spy in spies:
            spy.wait(timeout=10)
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
    logs = sorted(p.name for p in tmp_path.glob("py-spy-*.log"))
    assert logs == [f"py-spy-ingress-{ingress}-c64.log", f"py-spy-pool-replica-{pool}-c64.log"]
    args = (tmp_path / f"py-spy-pool-replica-{pool}-c64.log").read_text().split()
    assert args[args.index("--pid") + 1] == str(pool)
    assert args[args.index("--duration") + 1] == "5"
    assert args[args.index("--output") + 1] == str(tmp_path / f"py-spy-pool-replica-{pool}-c64.txt")
    assert ("--native" in args) is native


def test_thread_cpu_is_counted_for_the_pool_and_ingress_replicas_only() -> None:
    import os
    import signal
    import subprocess
    import time

    import psutil

    titles = ("ServeReplica:llm:pool-low-latency", "ServeReplica:llm:Ingress", "raylet")
    busy = "ServeReplica:llm:pool-low-latency"  # spins; the others sleep
    script = " ".join(
        f"(exec -a '{t}' bash -c 'while :; do :; done') &"
        if t == busy
        else f"(exec -a '{t}' sleep 30) &"
        for t in titles
    )
    root = subprocess.Popen(["bash", "-c", script + " wait"], start_new_session=True)
    try:
        for _ in range(100):
            names = {_title(c) for c in psutil.Process(root.pid).children()}
            if set(titles) <= names:
                break
            time.sleep(0.05)
        before = streaming.thread_cpu_seconds(root.pid)
        for _ in range(100):  # until the spinner got 0.1 s of CPU (on a busy machine, later)
            time.sleep(0.1)
            after = streaming.thread_cpu_seconds(root.pid)
            if sum(after.get("pool replica", {}).values()) > 0.1 + sum(
                before.get("pool replica", {}).values()
            ):
                break
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
    assert set(after) == {"pool replica", "ingress"}
    (spinner,) = after["pool replica"]  # its one thread (named after its executable, bash)
    assert after["pool replica"][spinner] - before["pool replica"].get(spinner, 0.0) > 0.1
    assert sum(after["ingress"].values()) < 0.1


def test_py_spy_must_be_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PY_SPY", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="py-spy"):
        streaming.start_py_spy(1, 5, tmp_path, "c1")


def test_a_variant_names_its_environment() -> None:
    assert streaming.env_variant("default=") == ("default", {})
    assert streaming.env_variant("nice-0=A=0,B=x=y") == ("nice-0", {"A": "0", "B": "x=y"})
    with pytest.raises(argparse.ArgumentTypeError, match="NAME="):
        streaming.env_variant("=A=0")


def test_the_variant_argument_repeats_and_is_required() -> None:
    parser = argparse.ArgumentParser()
    streaming.add_variant_argument(parser)
    args = parser.parse_args(["--variant", "default=", "--variant", "nice-0=A=0"])
    assert dict(args.variant) == {"default": {}, "nice-0": {"A": "0"}}
    with pytest.raises(SystemExit):
        parser.parse_args([])
