"""A Python user's generation with llama-cpp-python, run by
tests/llama/test_python.py with the venv python of scripts/build-llama-cpp-python.sh, not with
the project's interpreter (it imports llama_cpp, never apir):

    python llamapy_generate.py MODEL N_PREDICT PROMPT LOGITS.npy

`Llama(model_path=MODEL, n_gpu_layers=-1)` (every layer offloaded), the prompt decoded with
logits for every position, then up to N_PREDICT tokens sampled greedily (temp 0: llama.cpp's
greedy sampler; top_k 1) until an end-of-generation token. Prints one JSON object on stdout:
{"prompt": [token ids], "generated": [token ids], "text": str, "gpu_offload": bool}; writes the
prompt's logits, float32 [n_prompt, n_vocab], to LOGITS.npy. One thread: on a shared 2-core
machine ggml's spinning workers make a 2-thread run slower, and the tokens do not depend on it."""

import json
import sys

import numpy as np
from llama_cpp import Llama, llama_supports_gpu_offload


def main() -> None:
    model, n_predict, prompt, logits_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    llm = Llama(model_path=model, n_gpu_layers=-1, n_ctx=256, n_threads=1, n_threads_batch=1, seed=0,
                logits_all=True, verbose=True)
    prompt_ids = llm.tokenize(prompt.encode())
    generated = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if llm.token_eos() == token or len(generated) == n_predict:
            break
        generated.append(token)
    np.save(logits_file, np.asarray(llm.scores[: len(prompt_ids)], dtype=np.float32))
    json.dump({"prompt": prompt_ids, "generated": generated, "gpu_offload": bool(llama_supports_gpu_offload()),
               "text": llm.detokenize(generated).decode(errors="replace")}, sys.stdout)


if __name__ == "__main__":
    main()
