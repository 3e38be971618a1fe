// Per-layer KV cache settings: the spec language of --kv-layers and llama_kvq_set_layer_types, for types, of
// --kv-clip and llama_kvq_set_clip, for clip ratios, of --kv-rotate and llama_kvq_set_rotation, for rotation, and of
// --kv-dither and llama_kvq_set_dither, for the spread of V's dithered rounding.
//
//   spec    := "asymkv:" L_K "/" L_V | part (";" part)*      (asymkv: types only)
//   part    := ("k" | "v") ":" rule ("," rule)*
//   rule    := range "=" VALUE                     (a type name, a ratio in (0, 1] or mse, or on/off)
//   range   := "*" | N | N "-" | N "-" M            (layers, inclusive; "N-" runs to the last layer)
//
// asymkv:L_K/L_V is AsymKV's notation: K is kivi2 in the first L_K layers and kivi1 after, V likewise.
// A part must give every layer exactly one value; a part left out keeps the context's type_k or type_v (a ratio
// of 1: no clipping). Parse errors are reported when the spec is set; layer bounds once the model's layer count
// is known.

#include "llama-kvq-layers.h"

#include "ggml.h"
#include "ggml-kvq.h"
#include "llama-kvq.h"

#include <cstdlib>
#include <stdexcept>

std::string llama_kvq_cache_type_names(void) {
    std::string out;
    for (size_t i = 0; i < llama_kvq_n_cache_types(); ++i) {
        out += (i ? ", " : "") + std::string(ggml_type_name(llama_kvq_cache_type(i)));
    }
    return out;
}

ggml_type llama_kvq_cache_type_by_name(const std::string & name) {
    for (size_t i = 0; i < llama_kvq_n_cache_types(); ++i) {
        if (name == ggml_type_name(llama_kvq_cache_type(i))) {
            return llama_kvq_cache_type(i);
        }
    }
    return GGML_TYPE_COUNT;
}

namespace {

struct kvq_rule {
    int32_t     first;
    int32_t     last;   // -1: up to the last layer
    std::string value;
    std::string text;
};

// what the values of a spec are: parse() throws std::invalid_argument for a bad one
template <typename T>
struct kvq_values {
    const char * what;       // "TYPE", "RATIO"
    const char * noun;       // "type", "ratio"
    const char * label;      // what a spec of them is, for messages
    const char * example;    // a rule
    bool         asymkv;     // whether AsymKV's asymkv:L_K/L_V names them
    T (*parse)(const std::string & value, const std::string & where);
};

struct kvq_part {
    bool                  given = false;
    std::vector<kvq_rule> rules;
};

struct kvq_spec {
    bool     asymkv = false;
    int32_t  l_k    = 0;
    int32_t  l_v    = 0;
    kvq_part k;
    kvq_part v;
};

std::string kvq_trim(const std::string & s) {
    const size_t b = s.find_first_not_of(" \t");
    const size_t e = s.find_last_not_of(" \t");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::vector<std::string> kvq_split(const std::string & s, char sep) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t pos; (pos = s.find(sep, start)) != std::string::npos; start = pos + 1) {
        out.push_back(kvq_trim(s.substr(start, pos - start)));
    }
    out.push_back(kvq_trim(s.substr(start)));
    return out;
}

[[noreturn]] void kvq_fail(const std::string & where, const std::string & why) {
    throw std::invalid_argument("in '" + where + "': " + why);
}

int32_t kvq_parse_layer(const std::string & text, const std::string & where) {
    char * end = nullptr;
    const long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || v < 0 || v > 1000000) {
        kvq_fail(where, "'" + text + "' is not a layer number");
    }
    return (int32_t) v;
}

ggml_type kvq_parse_type(const std::string & name, const std::string & where) {
    const ggml_type type = llama_kvq_cache_type_by_name(name);
    if (type == GGML_TYPE_COUNT) {
        kvq_fail(where, "unknown type '" + name + "' (valid: " + llama_kvq_cache_type_names() + ")");
    }
    return type;
}

float kvq_parse_clip(const std::string & value, const std::string & where) {
    if (value == "mse") {
        return GGML_KVQ_CLIP_MSE;
    }
    char * end = nullptr;
    const float v = std::strtof(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(v > 0.0f && v <= 1.0f)) {
        kvq_fail(where, "'" + value + "' is not a clip ratio in (0, 1] or mse");
    }
    return v;
}

float kvq_parse_spread(const std::string & value, const std::string & where) {
    char * end = nullptr;
    const float v = std::strtof(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !(v >= 0.0f && v <= 1.0f)) {
        kvq_fail(where, "'" + value + "' is not a spread in [0, 1]");
    }
    return v;
}

bool kvq_parse_on_off(const std::string & value, const std::string & where) {
    if (value != "on" && value != "off") {
        kvq_fail(where, "'" + value + "' is not on or off");
    }
    return value == "on";
}

const kvq_values<ggml_type> kvq_types    = { "TYPE",   "type",     "layer types", "0-15=kivi2", true,  kvq_parse_type };
const kvq_values<float>     kvq_clips    = { "RATIO",  "ratio",    "clip ratios", "0-15=0.9",   false, kvq_parse_clip };
const kvq_values<bool>      kvq_switches = { "on|off", "rotation", "rotation",    "0-15=on",    false, kvq_parse_on_off };
const kvq_values<float>     kvq_spreads  = { "SPREAD", "spread",   "V dither",    "0-15=0.5",   false, kvq_parse_spread };

// a rotation spec that sets every layer alike: on/off as the switches of the tools take them
bool kvq_rotation_everywhere(const std::string & spec, bool & on) {
    for (const char * word : { "on", "1", "true", "yes" }) {
        if (spec == word) {
            on = true;
            return true;
        }
    }
    for (const char * word : { "off", "0", "false", "no", "none" }) {
        if (spec == word) {
            on = false;
            return true;
        }
    }
    return false;
}

template <typename T>
kvq_rule kvq_parse_rule(const std::string & text, const kvq_values<T> & values) {
    const size_t eq = text.find('=');
    if (eq == std::string::npos) {
        kvq_fail(text, std::string("expected LAYERS=") + values.what + ", e.g. " + values.example);
    }
    const std::string range = kvq_trim(text.substr(0, eq));
    kvq_rule rule = { 0, -1, kvq_trim(text.substr(eq + 1)), text };
    values.parse(rule.value, text);
    if (range == "*") {
        return rule;
    }
    const size_t dash = range.find('-');
    rule.first = kvq_parse_layer(range.substr(0, dash), text);
    if (dash == std::string::npos) {
        rule.last = rule.first;
    } else if (dash + 1 < range.size()) {
        rule.last = kvq_parse_layer(range.substr(dash + 1), text);
        if (rule.last < rule.first) {
            kvq_fail(text, "the range " + range + " runs backwards");
        }
    }
    return rule;
}

template <typename T>
void kvq_parse_part(const std::string & text, kvq_spec & spec, const kvq_values<T> & values) {
    const size_t colon = text.find(':');
    const std::string name = kvq_trim(text.substr(0, colon));
    if (colon == std::string::npos || (name != "k" && name != "v")) {
        kvq_fail(text, "a part starts with k: or v:");
    }
    kvq_part & part = name == "k" ? spec.k : spec.v;
    if (part.given) {
        kvq_fail(text, "the " + name + ": part is given twice");
    }
    part.given = true;
    for (const std::string & rule : kvq_split(text.substr(colon + 1), ',')) {
        part.rules.push_back(kvq_parse_rule(rule, values));
    }
}

template <typename T>
kvq_spec kvq_parse(const std::string & text, const kvq_values<T> & values) {
    kvq_spec spec;
    const std::string asymkv = "asymkv:";
    if (values.asymkv && text.compare(0, asymkv.size(), asymkv) == 0) {
        const std::string counts = text.substr(asymkv.size());
        const size_t slash = counts.find('/');
        if (slash == std::string::npos) {
            kvq_fail(text, "expected asymkv:L_K/L_V, e.g. asymkv:16/0");
        }
        spec.asymkv = true;
        spec.l_k = kvq_parse_layer(counts.substr(0, slash), text);
        spec.l_v = kvq_parse_layer(counts.substr(slash + 1), text);
        return spec;
    }
    for (const std::string & part : kvq_split(text, ';')) {
        kvq_parse_part(part, spec, values);
    }
    return spec;
}

// AsymKV's split as the general form: high bits (kivi2) in the first l layers, kivi1 after
kvq_part kvq_asymkv_part(int32_t l, int32_t n_layer, const char * name) {
    if (l > n_layer) {
        kvq_fail(std::string("asymkv: ") + name + " = " + std::to_string(l),
                 "more layers than the model's " + std::to_string(n_layer));
    }
    kvq_part part;
    part.given = true;
    if (l > 0) {
        part.rules.push_back({ 0, l - 1, "kivi2", "0-" + std::to_string(l - 1) + "=kivi2" });
    }
    if (l < n_layer) {
        part.rules.push_back({ l, -1, "kivi1", std::to_string(l) + "-=kivi1" });
    }
    return part;
}

std::string kvq_layers_text(int32_t first, int32_t last) {
    return first == last ? "layer " + std::to_string(first) : "layers " + std::to_string(first) + "-" + std::to_string(last);
}

template <typename T>
std::vector<T> kvq_resolve_part(const kvq_part & part, const char * name, int32_t n_layer, T fallback,
                                const kvq_values<T> & values) {
    std::vector<T> out(n_layer, fallback);
    if (!part.given) {
        return out;
    }
    std::vector<const kvq_rule *> owner(n_layer, nullptr);
    for (const kvq_rule & rule : part.rules) {
        const int32_t last = rule.last < 0 ? n_layer - 1 : rule.last;
        if (rule.first >= n_layer || last >= n_layer) {
            kvq_fail(rule.text, "the model has " + std::to_string(n_layer) + " layers (0-" + std::to_string(n_layer - 1) + ")");
        }
        for (int32_t il = rule.first; il <= last; ++il) {
            if (owner[il] != nullptr) {
                kvq_fail(rule.text, std::string(name) + ": layer " + std::to_string(il) + " already has a " + values.noun + " from '" +
                         owner[il]->text + "'");
            }
            owner[il] = &rule;
            out[il]   = values.parse(rule.value, rule.text);
        }
    }
    for (int32_t il = 0; il < n_layer; ++il) {
        if (owner[il] == nullptr) {
            int32_t last = il;
            while (last + 1 < n_layer && owner[last + 1] == nullptr) {
                ++last;
            }
            kvq_fail(std::string(name) + ":", kvq_layers_text(il, last) + (il == last ? " has no " : " have no ") + values.noun);
        }
    }
    return out;
}

[[noreturn]] void kvq_fail_spec(const std::string & spec, const char * label, const std::invalid_argument & err) {
    throw std::invalid_argument(std::string(label) + " '" + spec + "' " + err.what());
}

template <typename T>
void kvq_check(const std::string & spec, const kvq_values<T> & values) {
    if (spec.empty() || spec == "none") {
        return;
    }
    try {
        kvq_parse(spec, values);
    } catch (const std::invalid_argument & err) {
        kvq_fail_spec(spec, values.label, err);
    }
}

} // namespace

void llama_kvq_check_layer_spec(const std::string & spec) {
    kvq_check(spec, kvq_types);
}

void llama_kvq_check_clip_spec(const std::string & spec) {
    kvq_check(spec, kvq_clips);
}

llama_kvq_layer_clips llama_kvq_resolve_clip_spec(const std::string & spec, int32_t n_layer) {
    if (spec.empty() || spec == "none") {
        return { std::vector<float>(n_layer, 1.0f), std::vector<float>(n_layer, 1.0f) };
    }
    try {
        const kvq_spec parsed = kvq_parse(spec, kvq_clips);
        return { kvq_resolve_part(parsed.k, "k", n_layer, 1.0f, kvq_clips),
                 kvq_resolve_part(parsed.v, "v", n_layer, 1.0f, kvq_clips) };
    } catch (const std::invalid_argument & err) {
        kvq_fail_spec(spec, kvq_clips.label, err);
    }
}

void llama_kvq_check_rotation_spec(const std::string & spec) {
    bool on;
    if (spec.empty() || kvq_rotation_everywhere(spec, on)) {
        return;
    }
    if (spec.find(':') == std::string::npos) {
        throw std::invalid_argument("rotation '" + spec + "' is neither on/off nor a per-layer spec (valid: on, off, " +
                                    "or per layer, e.g. k:*=on;v:0-3=off,4-=on)");
    }
    kvq_check(spec, kvq_switches);
}

llama_kvq_layer_rotation llama_kvq_resolve_rotation_spec(const std::string & spec, int32_t n_layer, bool fallback) {
    bool on = fallback;
    if (spec.empty() || kvq_rotation_everywhere(spec, on)) {
        return { std::vector<bool>(n_layer, on), std::vector<bool>(n_layer, on) };
    }
    llama_kvq_check_rotation_spec(spec);
    try {
        const kvq_spec parsed = kvq_parse(spec, kvq_switches);
        return { kvq_resolve_part(parsed.k, "k", n_layer, false, kvq_switches),
                 kvq_resolve_part(parsed.v, "v", n_layer, false, kvq_switches) };
    } catch (const std::invalid_argument & err) {
        kvq_fail_spec(spec, kvq_switches.label, err);
    }
}

// a bare spread: every V layer alike
static bool kvq_dither_everywhere(const std::string & spec) {
    return spec.find(':') == std::string::npos;
}

void llama_kvq_check_dither_spec(const std::string & spec) {
    if (spec.empty() || spec == "none") {
        return;
    }
    if (kvq_dither_everywhere(spec)) {
        try {
            kvq_parse_spread(spec, spec);
        } catch (const std::invalid_argument &) {
            throw std::invalid_argument("V dither '" + spec + "' is neither a spread in [0, 1] nor a per-layer spec " +
                                        "(valid: none, 0.5, or per layer, e.g. v:0-9=1,10-=0)");
        }
        return;
    }
    kvq_check(spec, kvq_spreads);
    if (kvq_parse(spec, kvq_spreads).k.given) {
        throw std::invalid_argument("V dither '" + spec + "' has a k: part: K's codes are always rounded to nearest " +
                                    "(a key's error moves every score it enters), give a v: part only");
    }
}

std::vector<float> llama_kvq_resolve_dither_spec(const std::string & spec, int32_t n_layer) {
    llama_kvq_check_dither_spec(spec);
    if (spec.empty() || spec == "none") {
        return std::vector<float>(n_layer, 0.0f);
    }
    if (kvq_dither_everywhere(spec)) {
        return std::vector<float>(n_layer, kvq_parse_spread(spec, spec));
    }
    try {
        return kvq_resolve_part(kvq_parse(spec, kvq_spreads).v, "v", n_layer, 0.0f, kvq_spreads);
    } catch (const std::invalid_argument & err) {
        kvq_fail_spec(spec, kvq_spreads.label, err);
    }
}

llama_kvq_layer_types llama_kvq_resolve_layer_spec(const std::string & spec, int32_t n_layer, ggml_type type_k, ggml_type type_v) {
    if (spec.empty() || spec == "none") {
        return { std::vector<ggml_type>(n_layer, type_k), std::vector<ggml_type>(n_layer, type_v) };
    }
    try {
        const kvq_spec parsed = kvq_parse(spec, kvq_types);
        if (parsed.asymkv) {
            return { kvq_resolve_part(kvq_asymkv_part(parsed.l_k, n_layer, "L_K"), "k", n_layer, type_k, kvq_types),
                     kvq_resolve_part(kvq_asymkv_part(parsed.l_v, n_layer, "L_V"), "v", n_layer, type_v, kvq_types) };
        }
        return { kvq_resolve_part(parsed.k, "k", n_layer, type_k, kvq_types),
                 kvq_resolve_part(parsed.v, "v", n_layer, type_v, kvq_types) };
    } catch (const std::invalid_argument & err) {
        kvq_fail_spec(spec, kvq_types.label, err);
    }
}
