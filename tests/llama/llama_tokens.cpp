// llama_tokens: greedy generation with llama.cpp's public API (llama.h), printing the token ids
// and writing the prompt's logits, so two runs (through apir's host, and on local ggml CPU)
// can be compared token for token and logit for logit. Built by tests/llama/runner.py
// against the unmodified libllama of scripts/build-llama-cpp.sh. Same steps as llama.cpp's
// examples/simple/simple.cpp (tokenize, one prompt batch, greedy sampler, one token per decode),
// plus logits for every prompt position.
//
//   llama_tokens -m MODEL [-ngl N] [-n N_PREDICT] [-t THREADS] [--logits FILE] PROMPT
//
// stdout: "prompt: <ids>", "generated: <ids>" (stops early only at an end-of-generation token),
// "text: <generated text>", "vocab: <n_vocab>". --logits FILE: n_prompt x n_vocab float32 rows,
// the prompt's logits in position order. Exit status 1 on any llama.cpp error.
#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path, logits_path, prompt;
    int ngl = 99, n_predict = 64, n_threads = 0;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "-m" && i + 1 < argc) model_path = argv[++i];
        else if (a == "-ngl" && i + 1 < argc) ngl = atoi(argv[++i]);
        else if (a == "-n" && i + 1 < argc) n_predict = atoi(argv[++i]);
        else if (a == "-t" && i + 1 < argc) n_threads = atoi(argv[++i]);
        else if (a == "--logits" && i + 1 < argc) logits_path = argv[++i];
        else prompt = a;
    }
    if (model_path.empty() || prompt.empty()) {
        fprintf(stderr, "usage: %s -m MODEL [-ngl N] [-n N] [-t T] [--logits FILE] PROMPT\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mp);
    if (!model) { fprintf(stderr, "error: cannot load %s\n", model_path.c_str()); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), NULL, 0, true, true);
    std::vector<llama_token> toks(n_prompt);
    if (llama_tokenize(vocab, prompt.c_str(), prompt.size(), toks.data(), toks.size(), true, true) < 0) {
        fprintf(stderr, "error: tokenize\n"); return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_predict;
    cp.n_batch = n_prompt;
    if (n_threads > 0) { cp.n_threads = n_threads; cp.n_threads_batch = n_threads; }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "error: context\n"); return 1; }
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    printf("vocab: %d\nprompt:", n_vocab);
    for (auto t : toks) printf(" %d", t);
    printf("\n");

    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    for (int i = 0; i < n_prompt; i++) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, toks[i]);
        const llama_pos pos = i;
        llama_batch_ext_set_pos(batch, idx, &pos);
        llama_batch_ext_set_output_logits(batch, idx, true);
    }
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) { fprintf(stderr, "error: prompt decode\n"); return 1; }
    if (!logits_path.empty()) {
        FILE * f = fopen(logits_path.c_str(), "wb");
        if (!f) { perror(logits_path.c_str()); return 1; }
        for (int i = 0; i < n_prompt; i++) {
            const float * row = llama_get_logits_ith(ctx, i);
            if (!row || fwrite(row, sizeof(float), n_vocab, f) != (size_t) n_vocab) { fprintf(stderr, "error: logits\n"); return 1; }
        }
        fclose(f);
    }
    std::vector<llama_token> out;
    std::string text;
    for (int n_pos = n_prompt; (int) out.size() < n_predict; n_pos++) {
        const llama_token t = llama_sampler_sample(smpl, ctx, -1);
        if (llama_vocab_is_eog(vocab, t)) break;
        out.push_back(t);
        char buf[256];
        const int n = llama_token_to_piece(vocab, t, buf, sizeof(buf), 0, true);
        if (n > 0) text.append(buf, n);
        if ((int) out.size() == n_predict) break;
        llama_batch_ext_clear(batch);
        const int32_t idx = llama_batch_ext_add_token(batch, 0, t);
        const llama_pos pos = n_pos;
        llama_batch_ext_set_pos(batch, idx, &pos);
        llama_batch_ext_set_output_logits(batch, idx, true);
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) { fprintf(stderr, "error: decode at %d\n", n_pos); return 1; }
    }
    printf("generated:");
    for (auto t : out) printf(" %d", t);
    printf("\n");
    for (auto & c : text) if (c == '\n') c = ' ';
    printf("text: %s\n", text.c_str());
    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
