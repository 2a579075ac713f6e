#!/usr/bin/env python3
"""A Hugging Face Llama directory that infer generated (`engine make-model`, the runner
bench's 0.5B Llama) as a GGUF for llama.cpp, written by llama.cpp's own converter, so that
llama.cpp serves the very weights infer serves.

    python3 scripts/to_gguf.py LLAMA_CPP_SOURCE MODEL_DIR OUT.gguf [OUTTYPE]

LLAMA_CPP_SOURCE is a llama.cpp source tree (the one `scripts/foreign_servers.sh` builds
from); OUTTYPE defaults to bf16, the dtype `engine serve --dtype bf16` computes in. Needs
torch and transformers (`pip install torch transformers`), as the converter does.

The generated tokenizers are byte-level BPE with GPT-2's split pattern; the converter knows
pre-tokenizers by a hash of how they split a test text, and has no hash for a tokenizer it
has never seen, so it is told the pattern ("gpt-2") when it does not recognise one.
"""
import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    source, model, out = (Path(a) for a in sys.argv[1:4])
    outtype = sys.argv[4] if len(sys.argv) == 5 else "bf16"
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion import base  # llama.cpp's converter package

    known = base.TextModel.get_vocab_base_pre

    def vocab_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_pre
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
