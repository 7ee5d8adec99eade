"""Prompts written for self-distillation, and documentation text found on the machine.

The model answers these prompts itself (the head learns the target's own continuations), so
they only need to resemble what a deployed model is asked: chat, code, questions about a given
text, summaries. The grounded and summary prompts are built from Python's own documentation
(pydoc), so no text is downloaded. None of this is the benchmark suite (specedge/bench/prompts.json),
which stays unseen by training, nor benchmarks/experiments/heads/head_diagnose.py's held-out prompts (a test checks
both: no training prompt holds one of theirs, or is held by one).
"""

from __future__ import annotations

import importlib
import pydoc

CHAT = [
    "What should I pack for a three-day hiking trip in the mountains?",
    "Give me three tips for sleeping better.",
    "How do I politely decline a meeting invitation?",
    "What is the difference between a lake and a pond?",
    "Suggest a simple vegetarian dinner I can cook in twenty minutes.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Write a short, friendly message welcoming a new colleague to the team.",
    "What are the pros and cons of working from home?",
    "How can I start learning to play the guitar?",
    "Explain what a budget is and why it helps.",
    "Write a haiku about autumn leaves.",
    "What are good ways to practise a new language every day?",
    "How does a refrigerator keep food cold?",
    "List five fun things to do on a rainy weekend.",
    "What is photosynthesis?",
    "Give me a short motivational quote and explain it.",
]
CODE = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "How do I read a CSV file in Python and print each row?",
    "Write a JavaScript function that removes duplicates from an array.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a SQL query that counts orders per customer.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a bash command that finds all .txt files in a folder.",
    "What is the difference between a tuple and a list in Python?",
    "Write a Python function that merges two sorted lists.",
    "Write a C function that reverses a string in place.",
    "How do I handle exceptions in Python? Show an example.",
    "Write a Python function that counts the words in a text.",
    "Explain recursion with a short Python example.",
    "Write a Python script that prints the multiplication table from 1 to 9.",
    "How do I sort a list of dictionaries by a key in Python?",
]
# Modules whose documentation serves as reading material (grounded questions and summaries) and as
# plain text; the standard library is on every machine Python runs on.
DOC_MODULES = (
    "json",
    "textwrap",
    "string",
    "itertools",
    "functools",
    "collections",
    "pathlib",
    "re",
    "math",
    "statistics",
    "random",
    "datetime",
    "csv",
    "argparse",
    "heapq",
    "bisect",
    "shutil",
    "glob",
    "fnmatch",
    "difflib",
    "calendar",
    "fractions",
    "decimal",
    "enum",
    "dataclasses",
    "contextlib",
    "logging",
    "unittest",
    "zipfile",
    "tarfile",
    "sqlite3",
    "html",
    "urllib.parse",
    "base64",
    "hashlib",
)


def module_doc(name: str) -> str:
    """pydoc's plain-text documentation of module `name` ('' when it cannot be imported)."""
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return ""
    return pydoc.render_doc(mod, renderer=pydoc.plaintext)


def doc_excerpt(name: str, chars: int = 1200) -> str:
    """The opening of a module's documentation, cut at a line end."""
    text = module_doc(name)[:chars]
    return text[: text.rfind("\n")] if "\n" in text else text


def distill_prompts() -> list[tuple[str, str]]:
    """(category, user message) pairs: chat and code prompts, then per documented module a
    grounded question, a summary and a usage example over an excerpt of its documentation."""
    out = [("chat", p) for p in CHAT] + [("code", p) for p in CODE]
    for name in DOC_MODULES:
        excerpt = doc_excerpt(name)
        if not excerpt:
            continue
        out.append(
            (
                "grounded",
                f"Read this documentation:\n\n{excerpt}\n\nUsing only the text above, "
                f"what is the {name} module for, and what does it provide?",
            )
        )
        out.append(("summarization", f"Summarize the following documentation in a few sentences.\n\n{excerpt}"))
        out.append(
            (
                "code",
                f"Here is the start of the documentation of Python's {name} module:\n\n{excerpt}\n\n"
                f"Write a short Python example that uses it, and explain it.",
            )
        )
    return out


# More prompts from templates, written for training (not the bench suite, not head_diagnose's
# held-out prompts): everyday topics in several question forms, small coding tasks in four
# languages, and later excerpts of the same documentation than distill_prompts uses. A head
# learns from the number of distinct contexts it sees: more prompts raised held-out first-draft
# accuracy (benchmarks/history/heads.md, head_experiment.py variant F).
TOPICS = [
    "composting at home",
    "the water cycle",
    "time management",
    "learning to swim",
    "volcanoes",
    "saving for retirement",
    "public speaking",
    "the history of the printing press",
    "house plants",
    "electric cars",
    "the immune system",
    "chess openings",
    "baking bread",
    "solar panels",
    "bird migration",
    "job interviews",
    "the Roman empire",
    "meditation",
    "recycling plastics",
    "the moon's phases",
    "writing a CV",
    "caring for a puppy",
    "earthquakes",
    "healthy breakfasts",
    "the stock market",
    "learning to draw",
    "camping safety",
    "the human heart",
    "renewable energy",
    "board games for families",
    "running a first marathon",
    "the life of bees",
    "cloud computing",
    "first aid for burns",
    "planning a garden",
    "the French revolution",
    "climate zones",
    "podcasting",
    "vaccines",
    "travelling on a budget",
    "sleep cycles",
    "electric guitars",
    "ocean tides",
    "team sports for kids",
    "personal budgeting apps",
    "the invention of the telephone",
    "desert animals",
    "3D printing",
    "coffee brewing",
    "the theory of evolution",
]
TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are three common misconceptions about {t}?",
    "Give me a short beginner's guide to {t}.",
    "Write a short paragraph about {t} for a school newsletter.",
    "What should someone know before getting started with {t}?",
    "List the pros and cons of {t}.",
    "Tell me an interesting fact about {t} and why it matters.",
    "How would you explain {t} to a friend who knows nothing about it?",
]
TASKS = [
    "returns the smallest value in a dictionary",
    "checks whether a number is a perfect square",
    "counts the vowels in a string",
    "converts Celsius to Fahrenheit",
    "returns the factorial of n",
    "removes the whitespace from a string",
    "finds the second largest value in a list",
    "checks whether two strings are anagrams",
    "returns the sum of the digits of a number",
    "capitalizes the first letter of every word",
    "flattens a list of lists",
    "returns the n-th row of Pascal's triangle",
    "computes the greatest common divisor",
    "checks whether a year is a leap year",
    "counts how often each word appears in a text",
    "returns the running total of a list",
    "rotates a list by k positions",
    "validates an email address roughly",
    "converts a binary string to an integer",
    "returns the unique items of a list in order",
]
LANGS = ["Python", "JavaScript", "C", "Go"]


def more_prompts() -> list[tuple[str, str]]:
    """(category, user message) pairs from the templates above and further documentation excerpts."""
    out = [("chat", tpl.format(t=t)) for t in TOPICS for tpl in TEMPLATES]
    out += [("code", f"Write a {lang} function that {task}.") for task in TASKS for lang in LANGS]
    for name in DOC_MODULES:
        text = module_doc(name)
        for start in (1200, 2400):  # distill_prompts uses each module's first 1200 characters
            piece = text[start : start + 1200]
            piece = piece[piece.find("\n") + 1 : piece.rfind("\n")]
            if len(piece) < 400:
                continue
            out.append(("summarization", f"Summarize the following documentation in a few sentences.\n\n{piece}"))
            out.append(
                (
                    "grounded",
                    f"Read this documentation:\n\n{piece}\n\nUsing only the text above, what "
                    f"can this part of the {name} module be used for?",
                )
            )
    return out


def training_prompts() -> list[tuple[str, str]]:
    """Every prompt train-draft answers: distill_prompts, then more_prompts."""
    return distill_prompts() + more_prompts()
