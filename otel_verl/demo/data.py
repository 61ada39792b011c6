"""A tiny GSM8K-like dataset for the CPU harness, written locally as verl-ready parquet.

Every row is an addition word problem with exactly two numbers, laid out like verl's own
``examples/data_preprocess/gsm8k.py`` output (``data_source="openai/gsm8k"``, a chat ``prompt``,
``reward_model.ground_truth``, ``extra_info.index``), so verl's built-in rule-based reward
(``verl.utils.reward_score.gsm8k.compute_score``, picked by ``default_compute_score`` from the
data source) scores responses: 1.0 when the last ``#### <number>`` equals the ground truth,
0 otherwise.

For the tool agent (``agent="tool"``) the rows carry ``agent_name="tool_agent"``, a system
prompt asking for the ``calculator`` tool (as in verl's gsm8k multi-turn example) and
``extra_info.tools_kwargs`` for it.

    from otel_verl.demo.data import write_dataset
    train_path, val_path = write_dataset("/tmp/demo-data", agent="tool", train_size=16, val_size=4)
"""

from __future__ import annotations

import os
import random
from typing import Dict, List, Tuple

DATA_SOURCE = "openai/gsm8k"
# Same instruction verl's gsm8k preprocessing appends to every question.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Use the `calculator` tool to add the numbers before giving the final answer. "
    "Put your final answer in the format of `#### <answer>`."
)
AGENT_NAMES = {"single": "single_turn_agent", "tool": "tool_agent"}

_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Alexis", "Tina", "Randy"]
_TEMPLATES = [
    "{name} had {a} apples and bought {b} more. How many apples does {name} have now?",
    "A shop sold {a} pens in the morning and {b} pens in the afternoon. How many pens did it sell in total?",
    "{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read altogether?",
    "There are {a} red balls and {b} blue balls in a box. How many balls are in the box?",
    "{name} saved {a} dollars in May and {b} dollars in June. How much did {name} save in all?",
    "A farm has {a} cows and {b} sheep. How many animals does the farm have?",
]


def problems(count: int, seed: int = 0) -> List[Dict[str, object]]:
    """``count`` deterministic problems: ``{"question", "a", "b", "answer"}`` (answer = a + b)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = _TEMPLATES[i % len(_TEMPLATES)].format(name=rng.choice(_NAMES), a=a, b=b)
        out.append({"question": question, "a": a, "b": b, "answer": a + b})
    return out


def rows(count: int, *, split: str, agent: str = "single", seed: int = 0) -> List[Dict[str, object]]:
    """Parquet rows in verl's RLHFDataset layout."""
    if agent not in AGENT_NAMES:
        raise ValueError(f"agent must be one of {sorted(AGENT_NAMES)}, got {agent!r}")
    out = []
    for index, p in enumerate(problems(count, seed=seed)):
        answer = str(p["answer"])
        prompt = [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}]
        extra_info: Dict[str, object] = {
            "split": split,
            "index": index,
            "question": p["question"],
            "answer": f"{p['a']} + {p['b']} = {answer}\n#### {answer}",
        }
        if agent == "tool":
            prompt.insert(0, {"role": "system", "content": TOOL_SYSTEM_PROMPT})
            extra_info["need_tools_kwargs"] = True
            extra_info["tools_kwargs"] = {"calculator": {"create_kwargs": {"ground_truth": answer}}}
        out.append(
            {
                "data_source": DATA_SOURCE,
                "agent_name": AGENT_NAMES[agent],
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": extra_info,
            }
        )
    return out


def write_dataset(
    directory: str, *, agent: str = "single", train_size: int = 16, val_size: int = 4, seed: int = 0
) -> Tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` into ``directory``; returns both paths.

    Train and validation problems come from different seeds, so they differ.
    """
    import pandas as pd

    os.makedirs(directory, exist_ok=True)
    train_path = os.path.join(directory, "train.parquet")
    val_path = os.path.join(directory, "test.parquet")
    pd.DataFrame(rows(train_size, split="train", agent=agent, seed=seed)).to_parquet(train_path)
    pd.DataFrame(rows(val_size, split="test", agent=agent, seed=seed + 10_000)).to_parquet(val_path)
    return train_path, val_path
