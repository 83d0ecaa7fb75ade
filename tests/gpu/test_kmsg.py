"""Kernel-log Xid parser and /dev/kmsg reader (llama_guard.gpu.kmsg)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llama_guard.gpu.kmsg import KmsgOff, KmsgParser, KmsgReader, UnparsedXid, XidRecord, open_kmsg, strip_prefix

OURS = "00000000:02:00.0"  # NVML's spelling of our GPU


def parse(lines: list[str], pci: str | None = OURS) -> list[XidRecord | UnparsedXid]:
    p = KmsgParser(pci)
    return [r for line in lines for r in p.feed(line)]


@pytest.mark.parametrize(
    ("line", "xid", "pid", "name", "fell"),
    [
        # current drivers, kmsg record format
        ("4,1201,98765432,-;NVRM: Xid (PCI:0000:02:00): 79, pid=1234, name=llama-server, "
         "GPU has fallen off the bus.", 79, 1234, "llama-server", True),
        # no process involved
        ("NVRM: Xid (PCI:0000:02:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
         79, None, None, True),
        # dmesg text, newer "channel 0x..." wording
        ("[ 8123.456789] NVRM: Xid (PCI:0000:02:00): 31, pid=2345, name=python3, channel 0x00000012, "
         "intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_1a000000.", 31, 2345,
         "python3", False),
        # older "Ch ..." wording
        ("NVRM: Xid (PCI:0000:02:00): 43, pid=4242, name=llama-server, Ch 00000010", 43, 4242,
         "llama-server", False),
        # old drivers: no pid/name, no "PCI:" tag
        ("[  120.000001] NVRM: Xid (0000:02:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 0): "
         "Out Of Range Address", 13, None, None, False),
        ("6,77,1,-;NVRM: Xid (PCI:0000:02:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
         "(GPU Reset Required)", 154, None, None, False),
        ("NVRM: Xid (PCI:0000:02:00): 48, pid=999, name=llama-server, An uncorrectable double bit error "
         "(DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
         48, 999, "llama-server", False),
    ],
)
def test_xid_lines_across_generations(line: str, xid: int, pid: int | None, name: str | None, fell: bool) -> None:
    (rec,) = parse([line])
    assert (rec.pci, rec.xid, rec.pid, rec.name, rec.fallen_off_bus) == ("0000:02:00.0", xid, pid, name, fell)
    assert rec.text.startswith("NVRM: Xid")


def test_other_gpus_xids_are_ignored() -> None:
    lines = ["NVRM: Xid (PCI:0000:03:00): 79, pid=1, name=x, GPU has fallen off the bus.",
             "[ 1.0] NVRM: Xid (PCI:0001:02:00): 48, pid=2, name=y, DBE",
             "NVRM: Xid (PCI:0000:02:00): 63, pid='<unknown>', name=<unknown>, Row remapping event"]
    assert [r.xid for r in parse(lines)] == [63]
    assert [r.xid for r in parse(lines, pci=None)] == [79, 48, 63]


def test_multiline_fallen_off_the_bus_without_xid_number() -> None:
    lines = ["3,500,1,-;NVRM: The NVIDIA GPU 0000:02:00.0",
             "3,501,2,c;NVRM: (PCI ID: 10de:26b5) installed in this system has",
             "3,502,3,c;NVRM: fallen off the bus and is not responding to commands."]
    (rec,) = parse(lines)
    assert (rec.xid, rec.fallen_off_bus, rec.pci) == (None, True, "0000:02:00.0")
    assert "installed in this system" in rec.text
    other = [line.replace("0000:02:00.0", "0000:b3:00.0") for line in lines]
    assert parse(other) == []


def test_multiline_message_interleaved_with_other_kernel_lines() -> None:
    lines = ["NVRM: The NVIDIA GPU 0000:02:00.0", "usb 1-1: new device", " SUBSYSTEM=pci",
             "NVRM: (PCI ID: 10de:26b5) installed in this system has",
             "NVRM: fallen off the bus and is not responding to commands."]
    assert [r.fallen_off_bus for r in parse(lines)] == [True]


def test_single_line_fallen_off_the_bus() -> None:
    (rec,) = parse(["[ 99.1] NVRM: GPU 0000:02:00.0: GPU has fallen off the bus."])
    assert rec.fallen_off_bus
    assert rec.xid is None


def test_unrelated_nvrm_lines_from_the_real_h200_are_not_xids() -> None:
    lines = ["3,355,606718,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build",
             "4,357,3728021,c;NVRM: Persistence mode is deprecated and will be removed in a future release. "
             "Please use nvidia-persistenced instead."]
    assert parse(lines, pci=None) == []


def test_strip_prefix() -> None:
    assert strip_prefix("6,2,0,-;x86/split lock detection\n") == "x86/split lock detection"
    assert strip_prefix("[    3.498162] NVRM: Persistence") == "NVRM: Persistence"
    assert strip_prefix("NVRM: bare") == "NVRM: bare"


@pytest.mark.parametrize(
    ("line", "gi", "ci"),
    [("NVRM: Xid (PCI:0000:02:00 GPU-I:05): 94, pid=4242, name=llama-server, Contained: CE User Channel (0x9). "
      "RST: No, D-RST: No", 5, None),
     ("[ 77.1] NVRM: Xid (PCI:0000:02:00 GPU-I:05 GPU-CI:00): 94, pid=4242, name=llama-server, Contained: "
      "CE User Channel (0x9). RST: No, D-RST: No", 5, 0),
     ("4,9,1,-;NVRM: Xid (PCI:0000:02:00 GPU-I:0c): 31, pid=4242, name=llama-server, Ch 00000008", 12, None)],
)
def test_mig_xid_lines_parse(line: str, gi: int, ci: int | None) -> None:
    # On a MIG-partitioned GPU the kernel writes more attributes inside the parentheses.
    (rec,) = parse([line])
    assert isinstance(rec, XidRecord) and rec.pci == "0000:02:00.0" and rec.pid == 4242
    assert rec.name == "llama-server" and (rec.gpu_instance, rec.compute_instance) == (gi, ci)


def test_mig_xid_of_another_gpu_is_still_filtered() -> None:
    assert parse(["NVRM: Xid (PCI:0000:03:00 GPU-I:05): 94, pid=1, name=x, Contained"]) == []


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:02:00): fault without a number",
    "NVRM: Xid (PCI:0000:02:00 GPU-I:05",
    "NVRM: Xid (PCI:zz:zz): 79, pid=1, name=x",
    "[ 5.5] NVRM: Xid [GPU 0000:02:00]: 79 a future format",
])
def test_xid_lines_that_do_not_parse_come_back_raw(line: str) -> None:
    (rec,) = parse([line])
    assert isinstance(rec, UnparsedXid) and rec.text == strip_prefix(line)


# ---- the reader ------------------------------------------------------------------------------
def test_reader_reads_only_new_lines_of_a_file(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("6,1,0,-;old line\n")
    reader = open_kmsg(str(log))
    assert isinstance(reader, KmsgReader)
    with log.open("a") as fh:
        fh.write("6,2,1,-;NVRM: Xid (PCI:0000:02:00): 79, pid=1, name=x, GPU has fallen off the bus.\n6,3,2,-;par")
    assert reader.poll(0.1) == ["6,2,1,-;NVRM: Xid (PCI:0000:02:00): 79, pid=1, name=x, GPU has fallen off the bus."]
    with log.open("a") as fh:
        fh.write("tial\n")
    assert reader.poll(0.1) == ["6,3,2,-;partial"]
    reader.close()


def test_reader_on_a_pipe_times_out_then_reads() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    reader = KmsgReader(r)
    assert reader.poll(0.01) == []
    os.write(w, b"4,9,9,-;NVRM: hello\n")
    assert reader.poll(1.0) == ["4,9,9,-;NVRM: hello"]
    os.close(w)
    reader.close()


def test_unreadable_kmsg_is_said_once_as_a_value(tmp_path: Path) -> None:
    result = open_kmsg(str(tmp_path / "missing"))
    assert isinstance(result, KmsgOff)
    assert result.message.startswith("kernel log off")
    assert "missing" in result.message


def test_permission_denied_hints_at_cap_syslog(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("")
    f.chmod(0)
    if os.geteuid() != 0:
        result = open_kmsg(str(f))
        assert isinstance(result, KmsgOff)
        assert "CAP_SYSLOG" in result.reason
        return
    # As root every file is readable: check the same code as an unprivileged user (uid 65534).
    tmp_path.chmod(0o755)
    code = ("import sys; from llama_guard.gpu.kmsg import open_kmsg, KmsgOff; r = open_kmsg(sys.argv[1]); "
            "print(r.reason if isinstance(r, KmsgOff) else 'OPENED')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                          sys.executable, "-c", code, str(f)],
                         capture_output=True, text=True, timeout=60, check=False, env=env)
    assert out.returncode == 0, out.stderr
    assert "CAP_SYSLOG" in out.stdout, out.stdout
