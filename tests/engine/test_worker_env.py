"""The engine process starts with OpenMP's passive wait policy unless the user chose one, and the
parent's environment is left as it was."""

import multiprocessing as mp
import os

from kvserve.engine.worker import engine_environment


def _report(q) -> None:
    q.put(os.environ.get("OMP_WAIT_POLICY"))


def _child_sees(monkeypatch, preset: str | None) -> tuple[str | None, str | None]:
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
