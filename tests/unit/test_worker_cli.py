"""`python -m worker`'s own arguments: a bad one is one argparse line, not a traceback."""

from __future__ import annotations

import pytest

from worker.cli import build_parser


@pytest.mark.parametrize("argv, message", [
    (["stats", "--interval", "-1"], "argument --interval: must be 0 or more, got -1"),
    (["stats", "--watch", "0"], "argument --watch: must be above 0, got 0"),
    (["dead-letters", "--requeue", "notanid"], "'notanid' is not a stream entry id"),
    (["dead-letters", "--limit", "x"], "'x' is not a number"),
    (["calibrate", "--repeats", "0"], "argument --repeats: must be above 0"),
    (["demo", "--count", "-5"], "argument --count: must be above 0"),
])
def test_a_bad_command_argument_is_refused_with_one_line(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert message in error[-1] and len(error) == 2  # the short usage line, then the error


def test_good_command_arguments_parse() -> None:
    args = build_parser().parse_args(["dead-letters", "--requeue", "1733140000000-0",
                                      "--limit", "5"])
    assert args.requeue == ["1733140000000-0"] and args.limit == 5
    assert build_parser().parse_args(["stats", "--watch"]).watch == 2.0
    assert build_parser().parse_args(["stats", "--interval", "0"]).interval == 0.0
