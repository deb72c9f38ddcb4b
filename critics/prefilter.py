"""Cheap pre-filters: what can be said of a step from its record alone, before any model call.

A small model asked about an invalid action or a click that changed nothing spends
seconds to say what the record already says. The flags are kept on every critique;
`settle` turns the decisive ones into a label so the model is asked only about the rest.
"""

from __future__ import annotations

import json
from typing import Any

INVALID = "invalid_action"
NO_CHANGE = "no_change"
REPEATED = "repeated_action"


def flags(step: dict[str, Any], previous: dict[str, Any] | None) -> list[str]:
    """The pre-filter findings of `step`; `previous` is the step before it in the episode."""
    found = []
    if not step["action_valid"]:
        found.append(INVALID)
    # An older steps row has no tree after the action; then the screenshot and URL decide alone.
    tree_same = step.get("ax_tree_after") is None or step["ax_tree_after"] == step["ax_tree_before"]
    if step["screenshot_before"] == step["screenshot_after"] and step["url_before"] == step["url_after"] and tree_same:
        found.append(NO_CHANGE)
    if previous is not None and (previous["action_type"], json.loads(previous["action_json"])) == (
        step["action_type"],
        json.loads(step["action_json"]),
    ):
        found.append(REPEATED)
    return found


def settle(step: dict[str, Any], found: list[str]) -> tuple[str, str, str] | None:
    """(label, analysis, summary) when the flags decide the step, else None (a model should judge it).

    An invalid action wasted a step and counts towards stalling: HARMFUL. Repeating an
    action that changed nothing is a loop: HARMFUL. Ending the episode as a failure gives
    the task up (every query the factory writes has a path to its goal): HARMFUL, so an
    episode its checker accepts does not teach giving up at its end. A valid action that
    changed nothing once (or ended the episode as a success, or answered) moved the task
    neither way: NEUTRAL. A repeated action that did change the screen (pressing "+"
    twice) is left to the model. The summaries say the status and the answer, which the
    trajectory critic's channels read in place of the steps.
    """
    action = step["action_type"]
    args = json.loads(step["action_json"]) if step["action_valid"] else {}
    if action == "terminate" and INVALID not in found and args.get("status") == "failure":
        return "HARMFUL", "The agent gave up: it ended the episode with status failure.", "gave up (terminate: failure)"
    if INVALID in found:
        return "HARMFUL", f"The {action} action was invalid: {step['action_error']}.", f"invalid {action}"
    if NO_CHANGE in found and REPEATED in found:
        return (
            "HARMFUL",
            f"The {action} repeats the previous action and again changed neither the screen nor the URL.",
            f"repeated {action} with no effect",
        )
    if NO_CHANGE in found:
        if action == "terminate":
            status = args.get("status", "")
            return "NEUTRAL", f"The agent ended the episode with status {status}.", f"terminated: {status}"
        if action == "answer":
            return "NEUTRAL", "The agent answered; an answer changes nothing on the screen.", \
                f"answered {args.get('text', '')!r}"
        return "NEUTRAL", f"The {action} changed neither the screen, the accessibility tree nor the URL.", f"{action}: no change"
    return None
