"""Prompts written for self-distillation, and documentation text found on the machine.

The target answers these prompts itself (the head learns the target's own continuations), so
they only need to resemble what a deployed model is asked: chat, code, questions about a given
text, summaries. The grounded and summary prompts are built from Python's own documentation
(pydoc), so no text is downloaded. None of this is the benchmark suite (specedge/bench/prompts.json),
which stays unseen by training.
"""

from __future__ import annotations

import importlib
import pydoc

CHAT = [
    "What should I pack for a three-day hiking trip in the mountains?",
    "Give me three tips for sleeping better.",
    "How do I politely decline a meeting invitation?",
    "What is the difference between weather and climate?",
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
    "json", "textwrap", "string", "itertools", "functools", "collections", "pathlib", "re", "math",
    "statistics", "random", "datetime", "csv", "argparse", "heapq", "bisect", "shutil", "glob",
    "fnmatch", "difflib", "calendar", "fractions", "decimal", "enum", "dataclasses", "contextlib",
    "logging", "unittest", "zipfile", "tarfile", "sqlite3", "html", "urllib.parse", "base64", "hashlib",
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
        out.append(("grounded", f"Read this documentation:\n\n{excerpt}\n\nUsing only the text above, "
                                f"what is the {name} module for, and what does it provide?"))
        out.append(("summarization", f"Summarize the following documentation in a few sentences.\n\n{excerpt}"))
        out.append(("code", f"Here is the start of the documentation of Python's {name} module:\n\n{excerpt}\n\n"
                            f"Write a short Python example that uses it, and explain it."))
    return out
