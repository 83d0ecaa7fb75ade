"""Limits: parsing, the decision table, applying in a real child, reading back, non-root."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from llama_guard.config import Config, ConfigError, load_config
from llama_guard.config import limit_values as LC
from llama_guard.config.sections import LimitsConfig
from llama_guard.config.server import ServerConfig
from llama_guard.core.child import ChildSetup, popen
from llama_guard.limits import own as LO
from llama_guard.limits import plan as LP
from llama_guard.limits import readback as LR
from llama_guard.limits import rlimits as L
from llama_guard.limits.plan import LimitAction
from llama_guard.limits.rlimits import RLIM_INFINITY
from needs import unavailable


def problems(plan: LP.LimitPlan) -> tuple[str, ...]:
    """One sentence per limit the child gets less of than configured."""
    return tuple(d.problem for d in plan.decisions if d.problem)

MiB = 1 << 20


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("value", "sizes", "expected"),
    [
        (0, False, 0),
        (4096, False, 4096),
        ("4096", False, 4096),
        (" 4096 ", False, 4096),
        ("unlimited", False, RLIM_INFINITY),
        ("Unlimited", True, RLIM_INFINITY),
        ("infinity", False, RLIM_INFINITY),
        (-1, False, RLIM_INFINITY),
        ("64K", True, 64 * 1024),
        ("64k", True, 64 * 1024),
        ("64KiB", True, 64 * 1024),
        ("64M", True, 64 * MiB),
        ("64 MiB", True, 64 * MiB),
        ("64MB", True, 64 * MiB),
        ("2G", True, 2 << 30),
        ("1.5G", True, 3 << 29),
        ("1T", True, 1 << 40),
        ("123", True, 123),
    ],
)
def test_parse_limit_value(value: int | str, sizes: bool, expected: int) -> None:
    assert LC.parse_limit_value(value, sizes=sizes) == expected


@pytest.mark.parametrize(
    ("value", "sizes"),
    [(-2, False), ("", False), ("4K", False), ("64X", True), ("M", True), ("-5", True),
     ("lots", False), (True, False), ("1.5", False)],
)
def test_parse_limit_value_rejects(value: int | str, sizes: bool) -> None:
    with pytest.raises(ValueError, match=r"limit|negative"):
        LC.parse_limit_value(value, sizes=sizes)


def test_config_accepts_units_for_memlock_only() -> None:
    cfg = LimitsConfig(memlock="64M", nofile="65536", nproc="infinity")
    assert cfg.memlock == 64 * MiB
    assert cfg.nofile == 65536
    assert cfg.nproc == "unlimited"
    with pytest.raises(ValueError, match="whole number"):
        LimitsConfig(nofile="64K")
    with pytest.raises(ValueError, match="rearm_fraction"):
        LimitsConfig(warn_fraction=0.5, rearm_fraction=0.6)
    assert LimitsConfig(warn_fraction=0.9).rearm_at == pytest.approx(0.8)


def test_config_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lg.toml"
    path.write_text('[limits]\nmemlock = "1G"\nnofile = "unlimited"\n')
    cfg = load_config(path)
    assert cfg.limits.memlock == 1 << 30
    assert cfg.limits.nofile == "unlimited"
    monkeypatch.setenv("LLAMA_GUARD_LIMITS__MEMLOCK", "512K")
    assert load_config(path).limits.memlock == 512 * 1024
    path.write_text('[limits]\nmemlock = "lots"\n')
    monkeypatch.delenv("LLAMA_GUARD_LIMITS__MEMLOCK")
    with pytest.raises(ConfigError, match=r"limits\.memlock"):
        load_config(path)


def test_format_and_fix_hint() -> None:
    assert L.format_limit(RLIM_INFINITY) == "unlimited"
    assert L.format_limit(64 * MiB, "bytes") == "64 MiB (67108864 bytes)"
    assert L.format_limit(4096, "files") == "4096"
    hint = L.fix_hint(L.MEMLOCK, 64 * MiB)
    assert "LimitMEMLOCK=67108864" in hint
    assert "ulimit -Hl 65536" in hint  # ulimit -l counts KiB
    assert "--ulimit memlock=67108864:67108864" in hint
    hint = L.fix_hint(L.NOFILE, RLIM_INFINITY)
    assert "LimitNOFILE=infinity" in hint
    assert "ulimit -Hn unlimited" in hint
    assert "--ulimit nofile=-1:-1" in hint


# --------------------------------------------------------------------------- decision table


def _cfg(*, mlock: bool = False, threads: int | None = 4, threads_batch: int | None = None,
         parallel: int = 1, **limits: object) -> Config:
    return Config(server=ServerConfig(mlock=mlock, threads=threads, threads_batch=threads_batch,
                                      parallel=parallel),
                  limits=LimitsConfig(**limits))


def _own(nofile: tuple[int, int] = (1024, 4096), memlock: tuple[int, int] = (8 * MiB, 8 * MiB),
         nproc: tuple[int, int] = (10000, 10000), **kw: object) -> LO.OwnLimits:
    defaults: dict[str, object] = {"nr_open": 1048576, "cpu_count": 8, "euid": 1000}
    defaults.update(kw)
    return LO.OwnLimits(rlimits={"RLIMIT_NOFILE": nofile, "RLIMIT_MEMLOCK": memlock, "RLIMIT_NPROC": nproc},
                       **defaults)  # type: ignore[arg-type]


@pytest.mark.parametrize("privileged", [True, False])
@pytest.mark.parametrize(
    ("key", "name", "wanted", "own_hard"),
    [("nofile", "RLIMIT_NOFILE", 2048, 4096),
     ("memlock", "RLIMIT_MEMLOCK", 4 * MiB, 8 * MiB),
     ("nproc", "RLIMIT_NPROC", 5000, 10000)],
)
def test_within_hard_limit_is_set_either_way(privileged: bool, key: str, name: str, wanted: int,
                                             own_hard: int) -> None:
    cfg = _cfg(**{key: wanted})  # type: ignore[arg-type]
    plan = LP.plan_child_limits(cfg, _own(), privileged)
    d = plan.decision(name)
    assert d.action is LimitAction.SET
    assert d.target == (wanted, wanted)
    assert not d.problem
    assert (L.SPEC_BY_NAME[name].resource, (wanted, wanted)) in plan.settings


@pytest.mark.parametrize(
    ("key", "name", "wanted", "hard", "fixes"),
    [("nofile", "RLIMIT_NOFILE", 1048576, 4096,
      ["LimitNOFILE=1048576", "ulimit -Hn 1048576", "--ulimit nofile=1048576:1048576"]),
     ("memlock", "RLIMIT_MEMLOCK", "unlimited", 8 * MiB,
      ["LimitMEMLOCK=infinity", "ulimit -Hl unlimited", "--ulimit memlock=-1:-1"]),
     ("nproc", "RLIMIT_NPROC", 50000, 10000,
      ["LimitNPROC=50000", "ulimit -Hu 50000", "--ulimit nproc=50000:50000"])],
)
def test_above_hard_limit(key: str, name: str, wanted: int | str, hard: int, fixes: list[str]) -> None:
    cfg = _cfg(**{key: wanted})  # type: ignore[arg-type]
    root = LP.plan_child_limits(cfg, _own(), True).decision(name)
    want = LC.parse_limit_value(wanted, sizes=True)
    assert root.action is LimitAction.RAISE
    assert root.target == (want, want)
    assert not root.problem

    user = LP.plan_child_limits(cfg, _own(), False).decision(name)
    assert user.action is LimitAction.CAPPED
    assert user.target == (hard, hard)  # soft raised to the hard limit: the best reachable
    assert name in user.problem
    assert L.format_limit(hard, L.SPEC_BY_NAME[name].unit) in user.problem
    assert L.format_limit(want, L.SPEC_BY_NAME[name].unit) in user.problem
    assert "euid 1000" in user.problem
    for fix in fixes:
        assert fix in user.problem


def test_root_without_cap_sys_resource_is_named() -> None:
    plan = LP.plan_child_limits(_cfg(nofile=1048576), _own(euid=0), False)
    assert "root without CAP_SYS_RESOURCE" in plan.decision("RLIMIT_NOFILE").problem


def test_unset_limits_are_inherited() -> None:
    plan = LP.plan_child_limits(_cfg(nofile=None), _own(), True)
    for d in plan.decisions:
        assert d.action is LimitAction.INHERIT
        assert d.target is None
        assert d.effective == d.own
    assert plan.settings == ()
    assert problems(plan) == ()


def test_memlock_defaults_to_unlimited_with_mlock() -> None:
    d = LP.plan_child_limits(_cfg(mlock=True), _own(), True).decision("RLIMIT_MEMLOCK")
    assert d.configured == "unlimited"
    assert d.target == (RLIM_INFINITY, RLIM_INFINITY)
    assert "mlock" in d.note
    explicit = LP.plan_child_limits(_cfg(mlock=True, memlock="64M"), _own(), True).decision("RLIMIT_MEMLOCK")
    assert explicit.target == (64 * MiB, 64 * MiB)
    assert LP.plan_child_limits(_cfg(mlock=False), _own(), True).decision("RLIMIT_MEMLOCK").action \
        is LimitAction.INHERIT


def test_nofile_is_capped_by_nr_open_even_for_root() -> None:
    d = LP.plan_child_limits(_cfg(nofile="unlimited"), _own(nr_open=524288), True).decision("RLIMIT_NOFILE")
    assert d.target == (524288, 524288)
    assert not d.problem
    assert "nr_open" in d.note
    d = LP.plan_child_limits(_cfg(nofile=2000000), _own(nr_open=1048576), True).decision("RLIMIT_NOFILE")
    assert d.target == (1048576, 1048576)
    assert "sysctl -w fs.nr_open=2000000" in d.problem


def test_unlimited_hard_limit_allows_any_value() -> None:
    own = _own(nproc=(RLIM_INFINITY, RLIM_INFINITY))
    d = LP.plan_child_limits(_cfg(nproc="unlimited"), own, False).decision("RLIMIT_NPROC")
    assert d.action is LimitAction.SET
    assert d.target == (RLIM_INFINITY, RLIM_INFINITY)


def test_thread_notes() -> None:
    plan = LP.plan_child_limits(_cfg(threads=16, threads_batch=32), _own(cpu_count=8), True)
    assert any("threads = 16 exceeds the 8 CPUs" in n for n in plan.thread_notes)
    assert any("threads_batch = 32" in n for n in plan.thread_notes)
    # 1 main + 32 compute + max(1+2, 8-1)=7 http + 4 margin
    assert plan.estimated_threads == 44
    tight = LP.plan_child_limits(_cfg(threads=4, nproc=10), _own(cpu_count=8), False)
    assert any("RLIMIT_NPROC is 10" in n and "about 16 threads" in n and "LimitNPROC=" in n for n in tight.thread_notes)
    # root with CAP_SYS_RESOURCE is not held to RLIMIT_NPROC
    assert not any("RLIMIT_NPROC" in n for n in LP.plan_child_limits(
        _cfg(threads=4, nproc=10), _own(cpu_count=8), True).thread_notes)
    pids = LP.plan_child_limits(_cfg(threads=4), _own(cpu_count=8, pids_max=30, pids_current=20), True)
    assert any("pids.max is 30" in n and "TasksMax=" in n for n in pids.thread_notes)
    assert LP.plan_child_limits(_cfg(threads=4), _own(cpu_count=8), True).thread_notes == ()


# --------------------------------------------------------------------------- reading


PROC_LIMITS = textwrap.dedent("""\
    Limit                     Soft Limit           Hard Limit           Units
    Max cpu time              unlimited            unlimited            seconds
    Max processes             96364                96364                processes
    Max open files            1024                 524288               files
    Max locked memory         8388608              unlimited            bytes
    Max address space         unlimited            unlimited            bytes
""")


def test_parse_proc_limits() -> None:
    assert LR.parse_proc_limits(PROC_LIMITS) == {
        "RLIMIT_NPROC": (96364, 96364),
        "RLIMIT_NOFILE": (1024, 524288),
        "RLIMIT_MEMLOCK": (8388608, RLIM_INFINITY),
    }


def test_read_limits_of_self_matches_getrlimit() -> None:
    got = LR.read_limits(os.getpid())
    assert got.source == "psutil"
    for spec in L.SPECS:
        assert got.values[spec.name] == resource.getrlimit(spec.resource)
    assert LR.parse_proc_limits(Path("/proc/self/limits").read_text()) == dict(got.values)


def test_read_limits_of_missing_pid() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        LR.read_limits(proc.pid)


def test_can_raise_hard_limits_reads_capeff(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t000001ffffffffff\n")
    assert LO.can_raise_hard_limits(str(status))
    status.write_text("Name:\tx\nCapEff:\t000001fffeffffff\n")  # bit 24 cleared
    assert not LO.can_raise_hard_limits(str(status))


def test_cgroup_pids_v2_takes_smallest_up_the_path(tmp_path: Path) -> None:
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/system.slice/llama-guard.service\n")
    root = tmp_path / "cg"
    leaf = root / "system.slice" / "llama-guard.service"
    leaf.mkdir(parents=True)
    (leaf / "pids.max").write_text("max\n")
    (leaf / "pids.current").write_text("17\n")
    (root / "system.slice" / "pids.max").write_text("500\n")
    assert LO.cgroup_pids(42, root=str(root), proc=str(tmp_path / "proc")) == (500, 17)


def test_cgroup_pids_v1(tmp_path: Path) -> None:
    proc = tmp_path / "proc" / "7"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/x\n8:pids:/docker/abc\n")
    leaf = tmp_path / "cg" / "pids" / "docker" / "abc"
    leaf.mkdir(parents=True)
    (leaf / "pids.max").write_text("64\n")
    (leaf / "pids.current").write_text("3\n")
    assert LO.cgroup_pids(7, root=str(tmp_path / "cg"), proc=str(tmp_path / "proc")) == (64, 3)
    assert LO.cgroup_pids(8, root=str(tmp_path / "cg"), proc=str(tmp_path / "proc")) == (None, None)


# --------------------------------------------------------------------------- a real child


@pytest.fixture
def sleeper() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _proc_limits(pid: int) -> dict[str, tuple[int, int]]:
    return LR.parse_proc_limits(Path(f"/proc/{pid}/limits").read_text())


def test_apply_in_real_child_lowering(sleeper: list[subprocess.Popen[bytes]]) -> None:
    own = LO.read_own_limits()
    nofile_hard = own.rlimits["RLIMIT_NOFILE"][1]
    want_nofile = min(4096, nofile_hard)
    cfg = _cfg(nofile=want_nofile, memlock="1M", nproc=5000)
    plan = LP.plan_child_limits(cfg, own, LO.can_raise_hard_limits())
    assert problems(plan) == ()
    proc = popen(["sleep", "30"], os.environ, ChildSetup(rlimits=plan.settings), stdout=subprocess.DEVNULL)
    sleeper.append(proc)
    got = _proc_limits(proc.pid)
    assert got["RLIMIT_NOFILE"] == (want_nofile, want_nofile)
    assert got["RLIMIT_MEMLOCK"] == (MiB, MiB)
    assert got["RLIMIT_NPROC"] == (5000, 5000)
    back = LR.read_limits(proc.pid)
    assert dict(back.values) == got
    assert LR.verify_applied(plan, back) == []
    rows = {r["limit"]: r for r in LR.limits_report(plan, back)}
    assert rows["RLIMIT_MEMLOCK"]["effective"] == "1 MiB (1048576 bytes) / 1 MiB (1048576 bytes)"
    # The daemon's own limits are untouched.
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == own.rlimits["RLIMIT_NOFILE"]


def test_apply_in_real_child_above_hard(sleeper: list[subprocess.Popen[bytes]]) -> None:
    """Above the daemon's hard limit: raised when privileged, else capped with the fix named.

    On a host whose root lacks CAP_SYS_RESOURCE (a container) this exercises the refusal for real.
    """
    own = LO.read_own_limits()
    hard = own.rlimits["RLIMIT_NOFILE"][1]
    want = min(hard + 1000, own.nr_open or hard + 1000)
    if want <= hard:
        unavailable("the nofile hard limit already equals fs.nr_open")
    privileged = LO.can_raise_hard_limits()
    plan = LP.plan_child_limits(_cfg(nofile=want), own, privileged)
    proc = popen(["sleep", "30"], os.environ, ChildSetup(rlimits=plan.settings), stdout=subprocess.DEVNULL)
    sleeper.append(proc)
    got = _proc_limits(proc.pid)["RLIMIT_NOFILE"]
    if privileged:
        assert plan.decision("RLIMIT_NOFILE").action is LimitAction.RAISE
        assert got == (want, want)
    else:
        assert plan.decision("RLIMIT_NOFILE").action is LimitAction.CAPPED
        assert got == (hard, hard)
        (problem,) = problems(plan)
        assert f"LimitNOFILE={want}" in problem
    assert LR.verify_applied(plan, LR.read_limits(proc.pid)) == []


REFUSAL_SCRIPT = textwrap.dedent("""
    import json, os, subprocess
    from llama_guard.config import Config
    from llama_guard.config.sections import LimitsConfig
    from llama_guard.core.child import ChildSetup, popen
    from llama_guard.limits import own as LO, plan as LP, readback as LR
    own = LO.read_own_limits()
    hard = own.rlimits["RLIMIT_NOFILE"][1]
    if LO.can_raise_hard_limits() or own.nr_open is None or hard >= own.nr_open:
        print(json.dumps({"skip": f"cannot set up: privileged {LO.can_raise_hard_limits()}, hard {hard}, "
                                  f"nr_open {own.nr_open}"}))
        raise SystemExit(0)
    plan = LP.plan_child_limits(Config(limits=LimitsConfig(nofile=own.nr_open)), own, True)  # wrongly privileged
    child = popen(["sleep", "30"], os.environ, ChildSetup(rlimits=plan.settings), stdout=subprocess.DEVNULL)
    try:
        print(json.dumps({"hard": hard, "verify": LR.verify_applied(plan, LR.read_limits(child.pid))}))
    finally:
        child.kill(); child.wait()
""")


def test_kernel_refusal_is_caught_by_verify() -> None:
    """A plan that believed it was privileged (user namespace case): the child still starts, and
    reading back names the limit that was not raised. Run where raising is refused: as root, in a
    child whose bounding set lacks CAP_SYS_RESOURCE (setpriv), as a container's root is."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            unavailable("needs setpriv (util-linux) to drop CAP_SYS_RESOURCE")
        prefix = [setpriv, "--bounding-set=-sys_resource", "--inh-caps=-sys_resource"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    env["PYTHONPATH"] = str(Path(L.__file__).resolve().parents[1])
    out = subprocess.run([*prefix, sys.executable, "-c", REFUSAL_SCRIPT], capture_output=True, text=True,
                         timeout=60, env=env, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    if "skip" in result:
        unavailable(f"needs a process that cannot raise its nofile hard limit ({result['skip']})")
    (text,) = result["verify"]
    assert "RLIMIT_NOFILE" in text
    assert f"hard {result['hard']}" in text
    assert "LimitNOFILE=" in text


NON_ROOT_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, resource
    from llama_guard.core.child import ChildSetup, popen
    from llama_guard.limits import own as LO, plan as LP, readback as LR
    from llama_guard.config import Config
    from llama_guard.config.sections import LimitsConfig
    own = LO.read_own_limits()
    hard = own.rlimits["RLIMIT_NOFILE"][1]
    want = min(hard * 2, own.nr_open)
    plan = LP.plan_child_limits(Config(limits=LimitsConfig(nofile=want)), own, LO.can_raise_hard_limits())
    child = popen(["sleep", "30"], os.environ, ChildSetup(rlimits=plan.settings), stdout=subprocess.DEVNULL)
    try:
        back = LR.read_limits(child.pid)
    finally:
        child.kill(); child.wait()
    print(json.dumps({"euid": own.euid, "privileged": LO.can_raise_hard_limits(), "hard": hard, "want": want,
                      "action": plan.decision("RLIMIT_NOFILE").action.value,
                      "problems": [d.problem for d in plan.decisions if d.problem],
                      "child": back.values["RLIMIT_NOFILE"], "source": back.source,
                      "verify": LR.verify_applied(plan, back)}))
""")


def test_non_root_daemon_reports_the_fix() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        unavailable("needs root and setpriv to become uid 65534")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    env["PYTHONPATH"] = str(Path(L.__file__).resolve().parents[1])
    out = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
         NON_ROOT_SCRIPT],
        capture_output=True, text=True, timeout=60, env=env, cwd="/", check=False)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["euid"] == 65534
    assert res["privileged"] is False
    assert res["action"] == "capped"
    assert res["child"] == [res["hard"], res["hard"]]
    (problem,) = res["problems"]
    assert "RLIMIT_NOFILE" in problem
    assert "euid 65534" in problem
    assert f"LimitNOFILE={res['want']}" in problem
    assert f"ulimit -Hn {res['want']}" in problem
    assert f"--ulimit nofile={res['want']}:{res['want']}" in problem
    assert res["verify"] == []


def test_a_refused_limit_does_not_stop_the_exec() -> None:
    """A refused setting must not stop the exec (the parent reports it instead)."""
    bad = LP.LimitPlan(decisions=(), settings=((resource.RLIMIT_NOFILE, (10, 5)),))  # soft > hard: EINVAL
    proc = popen(["sh", "-c", "echo started"], os.environ, ChildSetup(rlimits=bad.settings), stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.decode().strip() == "started"
