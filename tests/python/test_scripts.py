"""The set-up scripts that `make test` runs before anything else."""
import subprocess

from conftest import ROOT


def _check_disk_with(tmp_path, free_mb):
    """scripts/check_disk.sh with a df that reports free_mb megabytes free on /work."""
    fake = tmp_path / "df"
    fake.write_text("#!/bin/sh\n"
                    "echo 'Filesystem 1048576-blocks Used Available Capacity Mounted on'\n"
                    f"echo '/dev/vda 250000 1000 {free_mb} 1% /work'\n")
    fake.chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "scripts" / "check_disk.sh")], capture_output=True, text=True,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin"})


def test_check_disk_stops_with_the_numbers_when_the_disk_is_short(tmp_path):
    r = _check_disk_with(tmp_path, 287)
    assert r.returncode == 1
    assert "make test needs about" in r.stderr and "/work has 287 MB free" in r.stderr, r.stderr


def test_check_disk_passes_when_there_is_room(tmp_path):
    r = _check_disk_with(tmp_path, 200000)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
