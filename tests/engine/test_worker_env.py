"""The engine process starts with OpenMP's passive wait policy (a short spin on an AMX CPU) unless the
user chose one, and the parent's environment is left as it was."""

import multiprocessing as mp
import os

import subprocess
import sys

from kvserve.engine import worker
from kvserve.engine.worker import engine_environment


def _report(q) -> None:
    q.put(os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"))


def _child_sees(monkeypatch, preset: str | None, amx: bool = False) -> tuple[str | None, str | None]:
    monkeypatch.setattr(worker, "amx_cpu", lambda: amx)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if preset is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", preset)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_report, args=(q,))
    with engine_environment():
        p.start()
    seen = q.get(timeout=60)
    p.join(60)
    return seen, os.environ.get("OMP_WAIT_POLICY")


def test_engine_process_waits_passively_and_the_parent_is_unchanged(monkeypatch):
    assert _child_sees(monkeypatch, None) == ("PASSIVE", None)


def test_a_users_wait_policy_is_kept(monkeypatch):
    assert _child_sees(monkeypatch, "ACTIVE") == ("ACTIVE", "ACTIVE")


def test_on_an_amx_cpu_the_engine_spins_briefly_instead(monkeypatch):
    assert _child_sees(monkeypatch, None, amx=True) == ("10000", None)
    assert os.environ.get("GOMP_SPINCOUNT") is None
    assert _child_sees(monkeypatch, "PASSIVE", amx=True) == ("PASSIVE", "PASSIVE")  # the user's choice wins


def test_the_cli_sets_what_its_engine_process_will_see(monkeypatch):
    """The CLI applies the engine's settings at import, before torch loads: an AMX CPU's spin count
    there, not a wait policy that would rule it out in the engine process it spawns."""
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    code = ("import os, sys; import kvserve.cli; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[2] == "False"  # kvserve.cli itself does not load torch before setting them
    want = ["None", worker.AMX_ENGINE_ENV["GOMP_SPINCOUNT"]] if worker.amx_cpu() else [
        worker.ENGINE_ENV["OMP_WAIT_POLICY"], "None"]
    assert out[:2] == want
