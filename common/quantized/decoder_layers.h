// The gguf engine's decoder layers in one call (included by kernels.cpp, after the products and decoder_ops.h).
//
// The layer loop written in Python (common/quantized/decoder.py as it was) made some 20 calls a layer from the
// interpreter, each paying Python's dispatch and a release and retake of the GIL, time llama.cpp does not spend:
// measured on 2 cores (Zen 4), the two loops interleaved in one process, a 1-token SmolLM2 step took 7.85 ms with
// it and 6.80 ms with this loop, the 1.5B's 33.6 against 30.2 ms. Every retake of the GIL could also wait for the
// worker's event loop, so a round's exchange and its pass slowed each other; here the GIL is released once for
// the whole loop.
//
// The loop calls the very functions the Python loop called (the products, rms_norm, rotary, attend_sessions, and
// ATen's silu or gelu, mul_ and add_), in the same order on the same tensors: its results are bit-identical to it
// (tests/unit/test_gguf_decoder.py keeps the Python loop as the reference and compares the logits bit for bit).
//
// One layer serves every architecture of common/quantized/architectures.py: the blocks some families have and
// others lack (QK-norm, the norms after attention and after the MLP, a sliding window, a second rotary table,
// soft-capped scores, GeGLU) are optional parts of it, absent where their tensor is undefined or their number 0.

// One linear layer on a kernel: y = x W^T (+ bias), as QuantizedLinear.product.
struct Linear {
    enum class Kernel { q4k, q6k, q41, q80 } kernel;  // in the order of kKernels
    std::vector<torch::Tensor> w;  // the kernel's operands after the activations, in its order
    int64_t n, k;
    torch::Tensor bias;  // undefined where there is none

    // Each kernel's name (PackedWeight.kernel) and how many weight tensors it takes.
    static constexpr std::pair<const char*, size_t> kKernels[] = {{"q4k", 5}, {"q6k", 4}, {"q41", 3}, {"q80", 2}};

    Linear(const std::string& name, std::vector<torch::Tensor> tensors, int64_t n, int64_t k, c10::optional<torch::Tensor> bias)
        : w(std::move(tensors)), n(n), k(k), bias(bias.has_value() ? *bias : torch::Tensor()) {
        size_t i = 0;
        while (i < std::size(kKernels) && name != kKernels[i].first) ++i;
        TORCH_CHECK(i < std::size(kKernels), "no kernel named ", name);
        TORCH_CHECK(w.size() == kKernels[i].second, name, " takes ", kKernels[i].second, " weight tensors, not ", w.size());
        kernel = static_cast<Kernel>(i);
    }

    torch::Tensor operator()(const torch::Tensor& x) const {
        torch::Tensor y;
        switch (kernel) {
            case Kernel::q4k: y = q4k_matmul(x, w[0], w[1], w[2], w[3], w[4], n, k); break;
            case Kernel::q6k: y = q6k_matmul(x, w[0], w[1], w[2], w[3], n, k); break;
            case Kernel::q41: y = q41_matmul(x, w[0], w[1], w[2], n, k); break;
            case Kernel::q80: y = q80_matmul(x, w[0], w[1], n, k); break;
        }
        return bias.defined() ? y.add_(bias) : y;
    }
};

using LinearSpec = std::tuple<std::string, std::vector<torch::Tensor>, int64_t, int64_t, c10::optional<torch::Tensor>>;

// Products that read one input (decoder.py's StackedProducts): a kernel call per group of layers stacked
// together, each call's output split into its layers', then put back in the order the layers were given.
struct Stacked {
    std::vector<std::pair<Linear, std::vector<int64_t>>> calls;
    std::vector<int64_t> order;

    Stacked(const std::vector<std::pair<LinearSpec, std::vector<int64_t>>>& specs, std::vector<int64_t> order) : order(std::move(order)) {
        for (const auto& [spec, sizes] : specs)
            calls.emplace_back(std::make_from_tuple<Linear>(spec), sizes);
        int64_t outputs = 0;
        for (const auto& call : calls) outputs += (int64_t)call.second.size();
        for (int64_t i : this->order) TORCH_CHECK(i >= 0 && i < outputs, "stacked products: order names output ", i, " of ", outputs);
    }

    std::vector<torch::Tensor> operator()(const torch::Tensor& x) const {
        std::vector<torch::Tensor> outputs;
        for (const auto& [linear, sizes] : calls)
            for (auto& y : linear(x).split_with_sizes(sizes, 1)) outputs.push_back(y);
        std::vector<torch::Tensor> ordered;
        for (int64_t i : order) ordered.push_back(outputs[i]);
        return ordered;
    }
};

using StackedSpec = std::pair<std::vector<std::pair<LinearSpec, std::vector<int64_t>>>, std::vector<int64_t>>;

struct Layer {
    torch::Tensor attention_norm, ffn_norm;
    double eps;
    Stacked qkv, gate_up;  // (q, k, v) and (gate, up)
    Linear o, down;
    int64_t head_dim;
    double scaling;
    // Optional blocks (undefined / 0 where the architecture has none).
    torch::Tensor q_norm, k_norm;                       // RMS norm of each head's q and k before the rotation (QK-norm)
    torch::Tensor post_attention_norm, post_ffn_norm;   // RMS norm of the attention's and the MLP's output (Gemma)
    bool gelu;          // the MLP's gate activation: GELU's tanh form (GeGLU) or SiLU (SwiGLU)
    int64_t window;     // sliding window of the attention (attend_sessions), 0 for full attention
    int64_t rope;       // which of forward's rotary tables this layer rotates with
    double softcap;     // attention scores' soft cap, 0 for none
};

inline torch::Tensor optional_tensor(const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); }

// y = rms_norm(x) * w where a norm is given, x itself where none is.
inline torch::Tensor maybe_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
    return w.defined() ? rms_norm(x, w, eps) : x;
}

// The layers of one model. forward(hidden, ...) runs them over a pass's rows, session after session, and returns
// hidden (updated in place): what decoder.py's loop did.
class DecoderLayers {
  public:
    DecoderLayers(int64_t heads, int64_t kv_heads) : heads_(heads), kv_heads_(kv_heads) {}

    void add_layer(torch::Tensor attention_norm, double eps, const StackedSpec& qkv, const LinearSpec& o, torch::Tensor ffn_norm,
                   const StackedSpec& gate_up, const LinearSpec& down, int64_t head_dim, double scaling,
                   c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                   c10::optional<torch::Tensor> post_attention_norm, c10::optional<torch::Tensor> post_ffn_norm, bool gelu,
                   int64_t window, int64_t rope, double softcap) {
        Stacked q_k_v(qkv.first, qkv.second), gate_and_up(gate_up.first, gate_up.second);
        TORCH_CHECK(q_k_v.order.size() == 3 && gate_and_up.order.size() == 2, "a layer takes q, k, v and gate, up");
        TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "a layer takes both QK norms or neither");
        TORCH_CHECK(window >= 0 && rope >= 0 && softcap >= 0, "a layer's window, rotary table and soft cap are not negative");
        layers_.push_back(Layer{attention_norm, ffn_norm, eps, std::move(q_k_v), std::move(gate_and_up),
                                std::make_from_tuple<Linear>(o), std::make_from_tuple<Linear>(down), head_dim, scaling,
                                optional_tensor(q_norm), optional_tensor(k_norm), optional_tensor(post_attention_norm),
                                optional_tensor(post_ffn_norm), gelu, window, rope, softcap});
    }

    int64_t size() const { return (int64_t)layers_.size(); }

    // cos[t], sin[t] [rows, dim]: rotary table t (a layer's `rope`); keys and values: each session's buffers of
    // each layer, layer after layer ([layer * sessions + session]).
    torch::Tensor forward(torch::Tensor hidden, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                          const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths) const {
        check_rows(hidden, "hidden");
        const int64_t rows = hidden.size(0), sessions = (int64_t)starts.size();
        TORCH_CHECK((int64_t)keys.size() == size() * sessions && values.size() == keys.size(),
                    "decoder layers: one key and one value buffer per layer and session");
        TORCH_CHECK(cos.size() == sin.size(), "decoder layers: as many cos as sin tables");
        for (const Layer& layer : layers_)
            TORCH_CHECK(layer.rope < (int64_t)cos.size(), "decoder layers: a layer rotates with table ", layer.rope, " of ", cos.size());
        for (int64_t l = 0; l < size(); ++l) {
            const Layer& layer = layers_[l];
            auto h = rms_norm(hidden, layer.attention_norm, layer.eps);
            auto qkv = layer.qkv(h);
            auto q = qkv[0].contiguous().view({rows, heads_, layer.head_dim});
            auto k = qkv[1].contiguous().view({rows, kv_heads_, layer.head_dim});
            auto v = qkv[2].contiguous().view({rows, kv_heads_, layer.head_dim});
            q = maybe_norm(q, layer.q_norm, layer.eps);  // over each head's dim features
            k = maybe_norm(k, layer.k_norm, layer.eps);
            rotary(q, cos[layer.rope], sin[layer.rope]);
            rotary(k, cos[layer.rope], sin[layer.rope]);
            const std::vector<torch::Tensor> layer_keys(keys.begin() + l * sessions, keys.begin() + (l + 1) * sessions);
            const std::vector<torch::Tensor> layer_values(values.begin() + l * sessions, values.begin() + (l + 1) * sessions);
            auto attended = layer.o(
                attend_sessions(q, k, v, layer_keys, layer_values, starts, lengths, layer.scaling, layer.window, layer.softcap));
            hidden.add_(maybe_norm(attended, layer.post_attention_norm, layer.eps));
            h = rms_norm(hidden, layer.ffn_norm, layer.eps);
            auto gate_up = layer.gate_up(h);
            // Not in place: gate is a column slice of the stacked product, and down's kernel takes contiguous rows.
            auto gate = layer.gelu ? at::gelu(gate_up[0], "tanh") : at::silu(gate_up[0]);
            hidden.add_(maybe_norm(layer.down(gate.mul_(gate_up[1])), layer.post_ffn_norm, layer.eps));
        }
        return hidden;
    }

  private:
    int64_t heads_, kv_heads_;
    std::vector<Layer> layers_;
};
