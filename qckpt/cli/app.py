"""The ``qckpt`` command: Typer app wiring and the one ``main()`` that maps errors to exit codes."""

from __future__ import annotations

import gc
import os
import signal
import sys
from typing import Any

import typer

from qckpt import __version__, phases
from qckpt.cli import calibrate, check, convert, export, init, inspect, load, plan, search
from qckpt.cli import eval as eval_
from qckpt.cli._errors import interruptible, report
from qckpt.term import quiet_third_party

app = typer.Typer(
    name="qckpt",
    help=(
        "Quantized checkpoints for large transformers: load a checkpoint into FP8/MXFP8/NVFP4 "
        "parameters with a streaming-dequant planner, calibrate amax over DP x EP x TP ranks, "
        "and export FP8 safetensors that serving stacks load."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("load")(interruptible(load.load_cmd))
app.command("calibrate")(interruptible(calibrate.calibrate_cmd))
app.command("export")(interruptible(export.export_cmd))
app.command("inspect")(interruptible(inspect.inspect_cmd))
app.command("convert")(interruptible(convert.convert_cmd))
app.command("check")(interruptible(check.check_cmd))
app.command("plan")(interruptible(plan.plan_cmd))
app.command("init")(interruptible(init.init_cmd))
app.command("eval")(interruptible(eval_.eval_cmd))
app.command("search")(interruptible(search.search_cmd))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    pass


def _terminate_as_interrupt() -> Any:
    """SIGTERM unwinds like Ctrl-C (temps removed, ``qckpt: interrupted``, exit 130). Not under
    torchrun: there a SIGTERM is torchrun stopping its workers, and a worker blocked in a
    collective must die at once, not when the collective returns."""
    from qckpt.cli.launch import under_torchrun

    if under_torchrun():
        return None

    from qckpt.atomic import Interrupted

    def _on_term(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signum}")

    return signal.signal(signal.SIGTERM, _on_term)


def main(argv: list[str] | None = None) -> None:
    phases.begin()  # the command's time and memory, from the process start (issue 18)
    quiet_third_party()
    old_term = _terminate_as_interrupt()
    from qckpt.kernel_policy import KernelPolicy, kernel_policy

    try:
        # the one place the kernel switches are read from the environment
        with kernel_policy(KernelPolicy.from_env(os.environ)):
            rv = app(args=argv, prog_name="qckpt", standalone_mode=False)
    except BaseException as exc:  # the one place exceptions become exit codes
        if isinstance(exc, SystemExit):
            raise
        sys.exit(report(exc))
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        phases.end()
        # The command is over. With torch and transformers loaded, the interpreter's last
        # garbage collection walks millions of objects (seconds on a busy host); refcounting
        # frees them anyway, so skip that walk: a survivor whose peer died then exits right
        # after its message instead of seconds later.
        gc.freeze()
    sys.exit(rv if isinstance(rv, int) else 0)
