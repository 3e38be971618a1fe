#include "llama-kvq-batch.h"

#include "llama-cparams.h"
#include "llama-kvq-cache.h"

#include <algorithm>

// rows read per token, which a copy would add to
static bool kvq_reads_every_token(const llama_cparams & cparams) {
    return cparams.embeddings || cparams.embeddings_nextn ||
           std::find(cparams.embeddings_layer_inp.begin(), cparams.embeddings_layer_inp.end(), true) !=
               cparams.embeddings_layer_inp.end();
}

static size_t kvq_n_unshared(const llama_batch_ext & batch) {
    size_t n = 0;
    for (const auto & token : batch.tokens) {
        n += std::max<size_t>(token.seq_ids.size(), 1);
    }
    return n;
}

// Upstream's coupled sequences: the ones a token shares hold the same positions, which batch allocation checks
// (it refuses them with the reason otherwise, as it refuses a sequence id out of range)
static bool kvq_coupled_alike(const llama_memory_i * mem, const llama_batch_ext & batch) {
    for (const auto & token : batch.tokens) {
        if (token.seq_ids.size() <= 1) {
            continue;
        }
        const llama_seq_id s0 = *token.seq_ids.begin();
        for (const llama_seq_id s : token.seq_ids) {
            if (s < 0 || s >= batch.n_seq_max || s0 < 0 || s0 >= batch.n_seq_max ||
                mem->seq_pos_min(s) != mem->seq_pos_min(s0) || mem->seq_pos_max(s) != mem->seq_pos_max(s0)) {
                return false;
            }
        }
    }
    return true;
}

bool llama_kvq_unshare_batch(const llama_memory_i * mem, const llama_cparams & cparams, const llama_batch_ext & batch,
        llama_kvq_unshared_batch & out) {
    const size_t n_tokens = kvq_n_unshared(batch);
    if (n_tokens == batch.tokens.size() || kvq_reads_every_token(cparams) || !llama_kvq_memory_has_kivi(mem) ||
        !kvq_coupled_alike(mem, batch)) {
        return false;
    }
    out.batch = std::make_unique<llama_batch_ext>(n_tokens, batch.n_embd_inp, batch.n_embd_inp_enc, batch.n_seq_max,
                                                  batch.mem, batch.n_vocab, batch.n_pos_per_embd);
    out.batch->n_embd = batch.n_embd;
    out.batch->embd   = batch.embd;
    out.batch->tokens.reserve(n_tokens);
    out.source.clear();
    out.source.reserve(n_tokens);
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
        const llama_batch_ext::token & token = batch.tokens[i];
        if (token.seq_ids.size() <= 1) {
            out.batch->tokens.push_back(token);
            out.source.push_back((int32_t) i);
            continue;
        }
        // in order of the sequence ids, so that the same batch always decodes alike
        std::vector<llama_seq_id> seq_ids(token.seq_ids.begin(), token.seq_ids.end());
        std::sort(seq_ids.begin(), seq_ids.end());
        for (size_t s = 0; s < seq_ids.size(); ++s) {
            llama_batch_ext::token copy = token;
            copy.seq_ids = { seq_ids[s] };
            copy.output  = token.output && s == 0;
            out.batch->tokens.push_back(std::move(copy));
            out.source.push_back((int32_t) i);
        }
    }
    return true;
}

void llama_kvq_map_outputs(const llama_kvq_unshared_batch & unshared, std::vector<int32_t> & out_ids) {
    if (!unshared.batch) {
        return;
    }
    for (int32_t & id : out_ids) {
        id = unshared.source[id];
    }
}
