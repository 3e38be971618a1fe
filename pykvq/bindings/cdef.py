"""The part of llama.h (pinned upstream), llama-kvq.h and llama-kvq-fit.h that pykvq's bindings call, for cffi's ABI
mode.

The two parameter structs are copied field by field from llama.h: cffi computes their layout from this text,
so it must match the C compiler's. tests/test_llama_abi.py compiles a probe against the real headers and
compares every size and offset. Enums are written as int and opaque pointer types as void *: same size and
calling convention on every platform we build for.
"""

LLAMA_CDEF = """
    typedef int32_t llama_pos;
    typedef int32_t llama_token;
    typedef int32_t llama_seq_id;
    struct llama_model;
    struct llama_context;
    struct llama_vocab;
    struct llama_sampler;

    typedef void (*ggml_log_callback)(int level, const char * text, void * user_data);
    void llama_log_set(ggml_log_callback log_callback, void * user_data);
    void llama_backend_init(void);
    bool llama_supports_gpu_offload(void);

    struct llama_model_tensor_buft_override {
        const char * pattern;
        void *       buft;
    };
    size_t llama_max_devices(void);
    size_t llama_max_tensor_buft_overrides(void);

    struct llama_model_params {
        void *        devices;
        const void *  tensor_buft_overrides;
        int32_t       n_gpu_layers;
        int           split_mode;
        int           load_mode;
        int           lazy_mode;
        int32_t       main_gpu;
        const float * tensor_split;
        void *        progress_callback;
        void *        progress_callback_user_data;
        const void *  kv_overrides;
        bool vocab_only;
        bool check_tensors;
        bool use_extra_bufts;
        bool no_host;
        bool no_alloc;
        bool load_mtp;
    };

    struct llama_context_params {
        uint32_t n_ctx;
        uint32_t n_batch;
        uint32_t n_ubatch;
        uint32_t n_seq_max;
        uint32_t n_rs_seq;
        uint32_t n_outputs_max;
        uint32_t n_outputs_max_per_seq;
        int32_t  n_threads;
        int32_t  n_threads_batch;
        int      ctx_type;
        int      rope_scaling_type;
        int      pooling_type;
        int      attention_type;
        int      flash_attn_type;
        float    rope_freq_base;
        float    rope_freq_scale;
        float    yarn_ext_factor;
        float    yarn_attn_factor;
        float    yarn_beta_fast;
        float    yarn_beta_slow;
        uint32_t yarn_orig_ctx;
        float    defrag_thold;
        void *   cb_eval;
        void *   cb_eval_user_data;
        int      type_k;
        int      type_v;
        void *   abort_callback;
        void *   abort_callback_data;
        bool embeddings;
        bool offload_kqv;
        bool no_perf;
        bool op_offload;
        bool swa_full;
        bool kv_unified;
        void *   samplers;
        size_t   n_samplers;
        struct llama_context * ctx_other;
    };

    typedef struct llama_batch {
        int32_t        n_tokens;
        llama_token *  token;
        float *        embd;
        llama_pos *    pos;
        int32_t *      n_seq_id;
        llama_seq_id ** seq_id;
        int8_t *       logits;
    } llama_batch;

    typedef struct llama_chat_message {
        const char * role;
        const char * content;
    } llama_chat_message;

    struct llama_perf_context_data {
        double t_start_ms;
        double t_load_ms;
        double t_p_eval_ms;
        double t_eval_ms;
        int32_t n_p_eval;
        int32_t n_eval;
        int32_t n_reused;
    };

    typedef struct llama_sampler_chain_params { bool no_perf; } llama_sampler_chain_params;

    struct llama_model_params   llama_model_default_params(void);
    struct llama_context_params llama_context_default_params(void);
    struct llama_sampler_chain_params llama_sampler_chain_default_params(void);

    struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
    void                 llama_model_free(struct llama_model * model);
    struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
    void                 llama_free(struct llama_context * ctx);

    uint32_t llama_n_ctx(const struct llama_context * ctx);
    uint32_t llama_n_batch(const struct llama_context * ctx);
    const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
    int32_t  llama_model_n_ctx_train(const struct llama_model * model);
    int32_t  llama_model_n_embd(const struct llama_model * model);
    int32_t  llama_model_n_layer(const struct llama_model * model);
    int32_t  llama_model_n_swa(const struct llama_model * model);
    bool     llama_model_has_encoder(const struct llama_model * model);
    int32_t  llama_model_n_head(const struct llama_model * model);
    int32_t  llama_model_n_head_kv(const struct llama_model * model);
    int32_t  llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
    uint64_t llama_model_size(const struct llama_model * model);
    const char * llama_model_chat_template(const struct llama_model * model, const char * name);
    int32_t  llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);

    int32_t     llama_vocab_n_tokens(const struct llama_vocab * vocab);
    bool        llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
    int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                           llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
    int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                                 int32_t lstrip, bool special);
    int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                      bool add_ass, char * buf, int32_t length);

    struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
    void    llama_batch_free(struct llama_batch batch);
    int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
    float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

    struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
    void    llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
    struct llama_sampler * llama_sampler_init_greedy(void);
    struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
    struct llama_sampler * llama_sampler_init_top_k(int32_t k);
    struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
    struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
    struct llama_sampler * llama_sampler_init_temp(float t);
    typedef struct llama_logit_bias { llama_token token; float bias; } llama_logit_bias;
    struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                         const llama_logit_bias * logit_bias);
    llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
    void    llama_sampler_free(struct llama_sampler * smpl);

    typedef struct llama_memory_i * llama_memory_t;
    llama_memory_t llama_get_memory(const struct llama_context * ctx);
    void      llama_memory_clear(llama_memory_t mem, bool data);
    bool      llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void      llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0,
                                  llama_pos p1);
    void      llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
    void      llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1,
                                   llama_pos delta);
    void      llama_memory_seq_div(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d);
    llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
    llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
    bool      llama_memory_can_shift(llama_memory_t mem);
    size_t llama_state_get_size(struct llama_context * ctx);
    size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
    size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
    bool   llama_state_save_file(struct llama_context * ctx, const char * path_session, const llama_token * tokens,
                                 size_t n_token_count);
    size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
    size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
    size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size,
                                    llama_seq_id dest_seq_id);

    struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
    void llama_perf_context_reset(struct llama_context * ctx);

    bool llama_kvq_set_params(struct llama_kvq_params params);
    bool llama_kvq_set_layer_types(const char * spec);
    bool llama_kvq_set_swa_types(int type_k, int type_v);
    void llama_kvq_get_swa_types(int * type_k, int * type_v);
    bool llama_kvq_set_param(const char * name, const char * value);
    bool llama_kvq_check_layer_types(const char * spec);
    const char * llama_kvq_get_layer_types(void);
    bool llama_kvq_set_clip(const char * spec);
    const char * llama_kvq_get_clip(void);
    bool llama_kvq_resolve_clip(const char * spec, int32_t n_layer, float * clip_k, float * clip_v);
    bool llama_kvq_set_dither(const char * spec);
    const char * llama_kvq_get_dither(void);
    bool llama_kvq_resolve_dither(const char * spec, int32_t n_layer, float * spread_v);
    bool llama_kvq_set_rotation(const char * spec);
    const char * llama_kvq_get_rotation(void);
    bool llama_kvq_resolve_rotation(const char * spec, int32_t n_layer, bool fallback, bool * rotate_k,
                                    bool * rotate_v);
    bool llama_kvq_resolve_layer_types(const char * spec, int32_t n_layer, int type_k, int type_v, int * types_k,
                                       int * types_v);
    struct llama_kvq_params llama_kvq_get_params(void);
    const char * llama_kvq_last_error(void);
    struct llama_kvq_memory_info {
        uint64_t bytes;
        uint64_t f16_bytes;
        uint64_t n_elements;
        uint64_t n_cells;
        uint32_t n_layers_kv;
        uint32_t n_seq_cells;
        uint64_t swa_bytes;
        uint64_t swa_n_cells;
        uint64_t swa_n_elements;
    };
    bool llama_kvq_memory_info(const struct llama_context * ctx, struct llama_kvq_memory_info * info);
    int64_t llama_kvq_seq_cells(const struct llama_context * ctx, llama_seq_id seq_id);

    int llama_kvq_fit_params(const char * path_model, struct llama_model_params * mparams,
                             struct llama_context_params * cparams, float * tensor_split,
                             struct llama_model_tensor_buft_override * tensor_buft_overrides, size_t * margins,
                             uint32_t n_ctx_min, bool verbose);
"""

# the structs copied from the headers, whose layout tests/test_llama_abi.py checks against the compiler's
MIRRORED_STRUCTS = ("llama_model_tensor_buft_override", "llama_model_params", "llama_context_params", "llama_batch",
                    "llama_chat_message", "llama_perf_context_data", "llama_kvq_params", "llama_kvq_memory_info")
