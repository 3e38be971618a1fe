// A token of several sequences at once, in a context whose KV cache has kivi layers.
#pragma once

#include "llama-batch.h"

#include <cstdint>
#include <memory>
#include <vector>

struct llama_cparams;
struct llama_memory_i;

// A kivi layer keeps every sequence's tokens in a part of its own, so a token of several sequences (a prompt decoded
// once for the endings that follow it: llama-perplexity's HellaSwag, Winogrande and multiple-choice scores) goes in
// once per sequence: the batch decoded holds, right after such a token, a copy of it for each of its other
// sequences, without output, and its outputs are the caller's tokens' again before they are read.
struct llama_kvq_unshared_batch {
    std::unique_ptr<llama_batch_ext> batch;
    std::vector<int32_t>             source; // per token of batch: the caller's token it is, or is a copy of
};

// Whether the caller's batch is decoded as out.batch. Not where every token is an output (embeddings) or its hidden
// rows are read per token (NextN, layer inputs): the cache then refuses the shared token with its reason.
bool llama_kvq_unshare_batch(const llama_memory_i * mem, const llama_cparams & cparams, const llama_batch_ext & batch,
        llama_kvq_unshared_batch & out);

// balloc's out_ids of an unshared batch, which name its tokens, name the caller's
void llama_kvq_map_outputs(const llama_kvq_unshared_batch & unshared, std::vector<int32_t> & out_ids);
