"""What constrained decoding costs the in-process model: milliseconds per generated token, held to
the policy's grammar against free decoding of the same prompts, in the same process.

The prompts are GUI-Owl's step prompt for a few tasks (no screenshot, so no OCR time); each is
answered free and constrained `--rounds` times, with the response cache off. Each round answers
every task one way, then every task the other: the model's kept cache then always holds another
task's prompt, so each call reads its task and what follows anew after the system message and
tools it keeps, as an episode's first step does (answered right after the other way on the same
prompt, the second call had skipped its whole prompt pass). The grammar's answers are shorter
(bounded reasoning), so the figure compared is time per token; the answer's validity is printed
beside it. Two more rows answer the same prompts with
transformers' own `generate`, a fresh cache each time: constrained with the grammar as a logits
mask (one forward pass per token, forced ones too), which the in-process model did before it fed
forced tokens in one pass, and free, which it did before free answers took its kept cache.

Prints a table; never asserts.

    python benchmarks/constrain_bench.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

from trajforge.envs.actions import validate
from trajforge.llm import Gateway, load_prompt
from trajforge.llm.local import load
from trajforge.llm.structured import Constraint, parse
from trajforge.rollout.gui_owl import ToolCall, call_schema, to_action, tool_spec
from trajforge.schemas.config import LLMSettings, LocalModelSettings

TASKS = ("Open the inbox and read the newest mail", "Add a large Pad Thai to the cart",
         "Turn the volume setting to high", "Create a note titled Groceries")
WIDTH, HEIGHT = 412, 732


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="Times each task is answered each way.")
    args = parser.parse_args()
    prompt = load_prompt("gui_owl_e2e")
    schema = call_schema("mobile", WIDTH, HEIGHT)
    figures = {mode: {"seconds": 0.0, "tokens": 0, "valid": 0, "answers": 0} for mode in ("free", "constrained")}
    for mode in figures:  # load the model and llguidance's tokenizer before timing
        with Gateway(LLMSettings(cache=False, reask=0, constrain=mode == "constrained")) as gw:
            gw.chat_sync(prompt.render(platform="mobile", width=WIDTH, height=HEIGHT, tools=tool_spec("mobile"),
                                       function="mobile_use", task="warm up", guidance=None, history=[],
                                       screenshots=[]), schema=ToolCall, json_schema=schema)
    model = load(LocalModelSettings())
    grammar = Constraint(prompt.format, schema).grammar
    theirs = {"constrained, transformers generate": grammar, "free, transformers generate": None}
    figures |= {mode: {"seconds": 0.0, "tokens": 0, "valid": 0, "answers": 0} for mode in theirs}
    prompts = [prompt.render(platform="mobile", width=WIDTH, height=HEIGHT, tools=tool_spec("mobile"),
                             function="mobile_use", task=task, guidance=None, history=[], screenshots=[])
               for task in TASKS]
    for _ in range(args.rounds):
        for mode, numbers in figures.items():
            for rendered in prompts:
                if mode in theirs:  # the model alone, no gateway
                    start = time.perf_counter()
                    tokens = model._generate(model._text_inputs(list(rendered.messages)), rendered.sampling,
                                             theirs[mode])
                    numbers["seconds"] += time.perf_counter() - start
                    numbers["tokens"] += len(tokens)
                    try:
                        parsed = parse(model.tokenizer.decode(tokens, skip_special_tokens=True), prompt.format,
                                       ToolCall)
                    except ValueError:
                        parsed = None
                else:
                    with Gateway(LLMSettings(cache=False, reask=0, constrain=mode == "constrained")) as gw:
                        start = time.perf_counter()  # the call, not the gateway's set-up
                        result = gw.chat_sync(rendered, schema=ToolCall, json_schema=schema)
                    numbers["seconds"] += time.perf_counter() - start
                    numbers["tokens"] += result.record.tokens_out or 0
                    parsed = result.parsed
                numbers["answers"] += 1
                if parsed is not None:
                    try:
                        numbers["valid"] += validate(to_action(parsed, "mobile_use"), WIDTH, HEIGHT) is None
                    except ValueError:
                        pass
    print(f"{'decoding':<36} {'answers':>7} {'valid':>6} {'tokens/answer':>13} {'ms/token':>9} {'s/answer':>9}")
    for mode, n in figures.items():
        print(f"{mode:<36} {n['answers']:>7} {n['valid']:>6} {n['tokens'] / n['answers']:>13.0f} "
              f"{1000 * n['seconds'] / n['tokens']:>9.1f} {n['seconds'] / n['answers']:>9.1f}")
    free, held = figures["free"], figures["constrained"]
    ratio = (held["seconds"] / held["tokens"]) / (free["seconds"] / free["tokens"])
    print(f"constrained / free, time per token: {ratio:.2f}")
    old = figures["constrained, transformers generate"]
    print(f"constrained, forced tokens in one pass / transformers generate, time per answer: "
          f"{(held['seconds'] / held['answers']) / (old['seconds'] / old['answers']):.2f}")
    plain = figures["free, transformers generate"]
    print(f"free, the kept cache / transformers generate, time per token: "
          f"{(free['seconds'] / free['tokens']) / (plain['seconds'] / plain['tokens']):.2f}")


if __name__ == "__main__":
    main()
