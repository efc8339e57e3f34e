"""Import-graph facts: ``hicache router`` and the tokenizer package never import torch.

The router proxies, tokenizes and hashes prompts; torch (and the model and
engine modules that need it) would cost it seconds of start-up and hundreds of
MiB for nothing. Each check runs in a fresh interpreter, since this one has
imported torch long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.tokenizer.byte_level_dir import byte_tokenizer_dir

# The command's own path up to serving: the CLI's argument parsing, the settings, the
# index, the policy and both apps built, then prompts tokenized as the router does at
# its first request; only uvicorn's serving and worker discovery (the network) are not.
ROUTER = """
import json
import hicache.router.serve as serve
from hicache.cli import main
from hicache.router.prompt import PromptKind, prompt_token_ids
from hicache.tokenizer.load import load_tokenizer

def build_without_serving(settings, index_factory, policy_factory):
    index = index_factory()
    policy = policy_factory(index, settings, [], {})
    serve.create_router_app(settings, index, policy)
    serve.create_pd_router_app(settings, index, policy, [], [])

serve.run_router = build_without_serving
assert main(["--log-level", "warning", "router", "--worker-urls", "http://127.0.0.1:9",
             "--tokenizer", TOKENIZER_DIR]) == 0
tokenizer = load_tokenizer(TOKENIZER_DIR)
chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
assert prompt_token_ids(PromptKind.CHAT, chat, tokenizer)
assert prompt_token_ids(PromptKind.COMPLETION, {"prompt": "hello"}, tokenizer)

# A worker on a file L3: the router's lookup of that pool (the file backend's settings,
# not its torch-reading backend).
from hicache.router.shared_pool import shared_pool_for_worker
pool = shared_pool_for_worker({
    "hicache_storage_backend": "file", "hicache_l3_key_seed": "0" * 32, "page_size": 16,
    "hicache_storage_backend_extra_config": json.dumps({"path": TOKENIZER_DIR}),
})
pool.close()
"""

# Every module of the package; a tokenizer loaded from its files, a chat rendered
# through its Jinja template and decoded as a stream; a GGUF file's tokenizer rebuilt.
TOKENIZER = """
import importlib, pkgutil
import hicache.tokenizer
for module in pkgutil.iter_modules(hicache.tokenizer.__path__):
    importlib.import_module(f"hicache.tokenizer.{module.name}")

from hicache.tokenizer.load import load_tokenizer
from hicache.tokenizer.detokenizer import IncrementalDetokenizer
from hicache.tokenizer.gguf import GGUFTokenizerFiles

tokenizer = load_tokenizer(TOKENIZER_DIR)
ids = tokenizer.encode_chat([{"role": "user", "content": "héllo"}])
detokenizer = IncrementalDetokenizer(tokenizer)
text = "".join(detokenizer.push(i) for i in ids) + detokenizer.flush()
assert "héllo" in text, text
GGUFTokenizerFiles.from_metadata({
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
    "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1],
})
"""


@pytest.fixture(scope="module")
def byte_tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer dir (tokenizer.json, a Jinja chat template): the HFTokenizer
    path, with its ``tokenizers`` and ``jinja2`` imports, is the one exercised."""
    return byte_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def torch_modules_after(code: str, tokenizer_dir: Path) -> list[str]:
    """The torch modules loaded once ``code`` has run in a fresh interpreter."""
    script = (
        f"TOKENIZER_DIR = {str(tokenizer_dir)!r}\n{code}\n"
        "import json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_router_command_imports_no_torch(byte_tokenizer_files: Path) -> None:
    assert torch_modules_after(ROUTER, byte_tokenizer_files) == []


def test_tokenizer_package_imports_no_torch(byte_tokenizer_files: Path) -> None:
    assert torch_modules_after(TOKENIZER, byte_tokenizer_files) == []
