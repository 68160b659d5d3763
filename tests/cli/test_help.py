"""Every argument of every command says what it takes: ``--help`` never shows a bare name.  The test walks
the parser itself, so an option added later without ``help=`` fails here."""

from __future__ import annotations

import argparse

from caffe_compat.cli import build_parser
from tests.cli.test_cli_errors import run_cli


def _parsers(parser: argparse.ArgumentParser, name: str = "caffe-compat"):
    """``(command line, parser)`` of the parser and of every sub-command, sub-sub-commands included."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {verb}")


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
            missing.append("/".join(action.option_strings) or action.metavar or action.dest)
        if isinstance(action, argparse._SubParsersAction):
            missing += [f"{choice.dest} (the command)" for choice in action._choices_actions if not choice.help]
    return missing


def test_every_argument_of_every_command_has_help():
    parsers = dict(_parsers(build_parser()))
    assert {"caffe-compat compute-mean", "caffe-compat upgrade", "caffe-compat models fetch"} <= set(parsers)
    undocumented = {name: missing for name, parser in parsers.items() if (missing := _undocumented(parser))}
    assert undocumented == {}


def test_the_walk_finds_an_argument_without_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["compute-mean"].add_argument("--new-option")
    assert _undocumented(sub.choices["compute-mean"]) == ["--new-option"]


def test_compute_mean_help_says_what_it_takes():
    done = run_cli("compute-mean", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "db the LMDB of Datum records to average" in text
    assert "out the mean .binaryproto to write" in text
