"""Shell completion: a user in bash can print, install and use it."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def _in_bash(cmd: str, env: dict) -> subprocess.CompletedProcess:
    # run from a real bash (as a user would): Typer finds the shell by walking up the process
    # tree; "; true" keeps bash from exec'ing python in its own place
    return subprocess.run(
        ["bash", "-c", f"{cmd}; true"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_show_completion_bash_prints_a_script(tmp_path):
    r = _in_bash(f"'{sys.executable}' -m qckpt --show-completion bash", {})
    assert "complete -o default -F _qckpt_completion qckpt" in r.stdout, r.stderr
    assert "_QCKPT_COMPLETE=complete_bash" in r.stdout and r.stderr == ""


def test_install_completion_writes_the_script_and_sources_it(tmp_path):
    r = _in_bash(f"'{sys.executable}' -m qckpt --install-completion", {"HOME": str(tmp_path)})
    assert "bash completion installed" in r.stdout, r.stdout + r.stderr
    script = tmp_path / ".bash_completions" / "qckpt.sh"
    assert "_qckpt_completion" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()


def test_completion_completes_commands_and_options():
    def complete(words: str, cword: int) -> list[str]:
        env = {"_QCKPT_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
        r = subprocess.run(
            [sys.executable, "-m", "qckpt"],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert complete("qckpt cal", 1) == ["calibrate"]
    assert "--set" in complete("qckpt load --se", 2)
