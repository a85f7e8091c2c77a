/*
 * lib/config.h - the model's configuration (ModelConfig) and reading it, strictly, from JSON: the
 * config.json of a transformers Qwen3 checkpoint (--init-from) and the "config" object of a
 * train_gpt checkpoint's manifest (--resume). Plain C on ckpt.h's JSON reader, so that the fuzzers
 * (test/fuzz/fuzz_config.c, fuzz_manifest.c) run the very code train_gpt reads them with.
 *
 * One table, CONFIG_FIELDS, names every field as each source calls it: the command line, the
 * manifest, config.json. Strict means every field there, an integer that fits an int and is
 * positive, a float that is finite and fits a float; a key twice is refused by the JSON reader.
 * Anything else is an error naming the file and the key. Whether the kernels can run a config
 * that reads well is config_check's question (train_gpt.cu), asked of every config alike.
 */
#ifndef CONFIG_H
#define CONFIG_H

#include <float.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include "../ckpt.h"

typedef struct {
    int vocab_size;  // V: rows of the tied embedding (GPT-2's 50257 tokens padded to 50304)
    int d_model;     // C
    int n_layer;     // L
    int n_head;      // Hq: query heads
    int n_kv_head;   // Hkv: key/value heads; each serves G = Hq / Hkv query heads
    int head_dim;    // D
    int ffn_dim;     // F: width of the SwiGLU hidden layer
    int seq_len;     // T: tokens per sequence (and the length of the RoPE table)
    float rope_theta;
    float norm_eps;
} ModelConfig;

#define MAX_LAYERS 256

static const ModelConfig DEFAULT_CONFIG = {
    .vocab_size = 50304,
    .d_model = 768,
    .n_layer = 12,
    .n_head = 6,
    .n_kv_head = 2,
    .head_dim = 128,
    .ffn_dim = 2048,
    .seq_len = 1024,
    .rope_theta = 10000.0f,
    .norm_eps = 1e-6f,
};

typedef struct {
    const char* flag;  // on the command line
    const char* ckpt;  // in a checkpoint manifest's "config"
    const char* hf;    // in transformers' config.json; NULL: not there (it has no sequence length)
    size_t offset;     // of the int, or the float, in ModelConfig
    int is_float;
} ConfigField;

#define N_CONFIG_FIELDS 10
static const ConfigField CONFIG_FIELDS[N_CONFIG_FIELDS] = {
    {"--vocab", "vocab_size", "vocab_size", offsetof(ModelConfig, vocab_size), 0},
    {"--d-model", "d_model", "hidden_size", offsetof(ModelConfig, d_model), 0},
    {"--layers", "n_layer", "num_hidden_layers", offsetof(ModelConfig, n_layer), 0},
    {"--heads", "n_head", "num_attention_heads", offsetof(ModelConfig, n_head), 0},
    {"--kv-heads", "n_kv_head", "num_key_value_heads", offsetof(ModelConfig, n_kv_head), 0},
    {"--head-dim", "head_dim", "head_dim", offsetof(ModelConfig, head_dim), 0},
    {"--ffn", "ffn_dim", "intermediate_size", offsetof(ModelConfig, ffn_dim), 0},
    {"--seq", "seq_len", NULL, offsetof(ModelConfig, seq_len), 0},
    {"--rope-theta", "rope_theta", "rope_theta", offsetof(ModelConfig, rope_theta), 1},
    {"--norm-eps", "norm_eps", "rms_norm_eps", offsetof(ModelConfig, norm_eps), 1},
};

// A field's value (an int or a float; a double holds either exactly), and setting it.
static double config_get(const ModelConfig* c, const ConfigField* f) {
    const char* at = (const char*)c + f->offset;
    return f->is_float ? (double)*(const float*)at : (double)*(const int*)at;
}

static void config_set(ModelConfig* c, const ConfigField* f, double v) {
    char* at = (char*)c + f->offset;
    if (f->is_float) *(float*)at = (float)v;
    else *(int*)at = (int)v;
}

// The field a command-line flag sets, or NULL.
static const ConfigField* config_field_of_flag(const char* flag) {
    for (int i = 0; i < N_CONFIG_FIELDS; i++)
        if (strcmp(CONFIG_FIELDS[i].flag, flag) == 0) return &CONFIG_FIELDS[i];
    return NULL;
}

// The config's members as a checkpoint manifest's config object holds them (the caller opens and
// closes the object, and may add members of its own).
static void model_config_members(const ModelConfig* c, JsonWriter* w) {
    for (int i = 0; i < N_CONFIG_FIELDS; i++) {
        const ConfigField* f = &CONFIG_FIELDS[i];
        jw_key(w, f->ckpt);
        if (f->is_float) jw_float(w, (float)config_get(c, f));
        else jw_int(w, (int64_t)config_get(c, f));
    }
}

// Reads member `key` of obj into field f of c: there, a number, and representable. Returns 0, or
// -1 with "KEY: what is wrong" in err (the caller adds the file).
static int config_field_read(const JsonDoc* doc, const JsonNode* obj, const char* key, const ConfigField* f,
                             ModelConfig* c, char* err, size_t err_len) {
    const JsonNode* v = json_get(doc, obj, key);
    if (!v) return fail(err, err_len, "no \"%s\"", key);
    if (v->type != JSON_NUMBER) return fail(err, err_len, "\"%s\" is not a number", key);
    if (f->is_float) {
        if (!isfinite(v->num) || fabs(v->num) > FLT_MAX || (v->num != 0.0 && fabs(v->num) < FLT_MIN))
            return fail(err, err_len, "\"%s\" is %g, not a finite number a float holds", key, v->num);
        config_set(c, f, v->num);
        return 0;
    }
    int64_t i;
    if (json_get_int(doc, obj, key, &i) != 0 || i < 1 || i > INT_MAX)
        return fail(err, err_len, "\"%s\" is %.17g, not a whole number from 1 to %d", key, v->num, INT_MAX);
    config_set(c, f, (double)i);
    return 0;
}

// Parses the text of a transformers Qwen3 config.json (read from path) into c; the sequence
// length, which config.json does not hold, is left as it is. Returns 0, or -1 with one line
// naming path and the key at fault.
static int hf_config_parse(const char* path, const char* text, size_t len, ModelConfig* c, char* err,
                           size_t err_len) {
    JsonDoc doc;
    char why[256];
    if (json_parse(&doc, text, len, why, sizeof why) != 0) return fail(err, err_len, "%s: %s", path, why);
    const JsonNode* root = json_root(&doc);
    const JsonNode* tied = json_get(&doc, root, "tie_word_embeddings");
    const char* type = NULL;
    int rc = 0;
    if (root->type != JSON_OBJECT)
        rc = fail(why, sizeof why, "not a JSON object");
    else if (json_get_string(&doc, root, "model_type", &type) != 0 || strcmp(type, "qwen3") != 0)
        rc = fail(why, sizeof why, "\"model_type\" is not \"qwen3\"");
    else if (tied && (tied->type != JSON_BOOL || !tied->num))  // absent: true, as our export writes it
        rc = fail(why, sizeof why, "\"tie_word_embeddings\" is not true; train_gpt's output head is the embedding");
    for (int i = 0; i < N_CONFIG_FIELDS && rc == 0; i++)
        if (CONFIG_FIELDS[i].hf) rc = config_field_read(&doc, root, CONFIG_FIELDS[i].hf, &CONFIG_FIELDS[i], c, why, sizeof why);
    json_free(&doc);
    return rc ? fail(err, err_len, "%s: %s", path, why) : 0;
}

// The model config of a transformers Qwen3 checkpoint directory: dir/config.json.
static int hf_config_read(const char* dir, ModelConfig* c, char* err, size_t err_len) {
    char path[CK_PATH_MAX];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return fail(err, err_len, "%s: path too long", dir);
    char* text;
    size_t len;
    if (read_whole_file(path, (size_t)1 << 20, &text, &len, err, err_len) != 0) return -1;
    int rc = hf_config_parse(path, text, len, c, err, err_len);
    free(text);
    return rc;
}

// Whether the config a checkpoint's manifest stores (node, in doc) is c; if not, err says which
// field, with both values, or what in the stored config is malformed.
static bool model_config_matches(const ModelConfig* c, const JsonDoc* doc, const JsonNode* node, char* err,
                                 size_t err_len) {
    if (!node || node->type != JSON_OBJECT) {
        fail(err, err_len, "the checkpoint has no config object");
        return false;
    }
    ModelConfig stored = *c;
    for (int i = 0; i < N_CONFIG_FIELDS; i++) {
        const ConfigField* f = &CONFIG_FIELDS[i];
        char why[256];
        if (config_field_read(doc, node, f->ckpt, f, &stored, why, sizeof why) != 0) {
            fail(err, err_len, "the checkpoint's config: %s", why);
            return false;
        }
        if (config_get(&stored, f) != config_get(c, f)) {
            fail(err, err_len, "the checkpoint's %s is %.9g, this run's (%s) is %.9g", f->ckpt, config_get(&stored, f),
                 f->flag, config_get(c, f));
            return false;
        }
    }
    return true;
}

#endif
