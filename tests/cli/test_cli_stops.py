"""A command that writes nothing, stopped from outside, does not advise a resume."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from shardprep.cli import main


def test_sigterm_to_plan_says_only_that_it_was_terminated(tiny, capsys) -> None:
    def terminate_inside(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "make_plan":
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, while it runs

    sys.setprofile(terminate_inside)
    try:
        code = main(["plan", str(tiny.model("llama"))])
    finally:
        sys.setprofile(None)
    assert code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "shardprep: terminated\n"
