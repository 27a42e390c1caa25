// fusedattn's cuDNN attention as a torch operator with its autograd in C++: the warm path.
//
// Python validates a call, selects the backend, builds and serializes the forward and backward
// graphs and registers them here once per configuration (a "torch plan": the two graphs plus the
// shapes and strides of every tensor the call reads and writes). A repeat call is then one
// operator call: torch.ops.fusedattn_native.attention(plan, q, k, v, sink, seed, offset). Its
// autograd kernel saves what the backward needs; forward and backward allocate their outputs from
// torch's caching allocator and launch the deserialized graph on torch's current stream.
// Meta kernels give the output shapes from the plan, so torch.compile traces the same operator.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "bounded.h"
#include "core_api.h"

namespace {

using at::Tensor;
using c10::optional;

// The launch core (launch_core.cc), a separate library with its own copy of the cuDNN frontend:
// its C functions, found when Python calls fusedattn_torch_init with its path.
fusedattn_native::CoreApi &core() {
    static fusedattn_native::CoreApi functions;
    return functions;
}

// Slot orders of the two graphs: Python registers each graph's uids in these orders.
enum ForwardSlot { kFwdQ, kFwdK, kFwdV, kFwdSink, kFwdSeed, kFwdOffset, kFwdO, kFwdStats, kForwardSlots };
enum BackwardSlot {
    kBwdQ, kBwdK, kBwdV, kBwdO, kBwdDO, kBwdStats, kBwdSink, kBwdSeed, kBwdOffset,
    kBwdDQ, kBwdDK, kBwdDV, kBwdDSink, kBackwardSlots
};
enum SinkKind { kNoSink = 0, kZeroSink = 1, kLearnableSink = 2 };

// FUSEDATTN_NATIVE_PROFILE=1 (the launch core reads it too): the operator's host time by step,
// averaged over the calls that reach each step, on stderr at exit. Off, a step costs one branch.
enum Step {
    kWhole, kForwardCall, kSave,  // the autograd kernel: all of it, its forward op, its node and saving
    kFwdPlan, kFwdGuard, kFwdInputs, kFwdOutputs, kFwdWorkspace, kFwdStream, kFwdExecute,
    kSaved, kBackwardCall, kGradients,  // AttentionBackward::apply
    kBwdPlan, kBwdRefuse, kBwdGuard, kBwdInputs, kBwdOutputs, kBwdWorkspace, kBwdStream, kBwdExecute,
    kSteps
};

const bool profiling = [] {
    const char *value = std::getenv("FUSEDATTN_NATIVE_PROFILE");
    return value != nullptr && value[0] == '1';
}();

struct StepTimes {
    std::atomic<int64_t> nanoseconds[kSteps] = {};
    std::atomic<int64_t> calls[kSteps] = {};

    double average_us(int step) const {
        int64_t n = calls[step].load();
        return n == 0 ? 0.0 : nanoseconds[step].load() / 1e3 / n;
    }
    int64_t sum_calls() const {
        int64_t sum = 0;
        for (const auto &n : calls) sum += n.load();
        return sum;
    }
    double sum_us(int first, int last) const {
        double sum = 0;
        for (int step = first; step <= last; ++step) sum += average_us(step);
        return sum;
    }

    ~StepTimes() {
        if (!profiling || sum_calls() == 0) return;
        const char *const names[] = {
            "attention: whole kernel", "attention: forward op", "attention: node, history, saving",
            "forward: find_plan", "forward: device guard", "forward: conform q,k,v, sink", "forward: outputs",
            "forward: workspace", "forward: stream", "forward: core execute",
            "backward: saved variables", "backward: backward op", "backward: gradients out",
            "backward op: find_plan", "backward op: refuse lse grad", "backward op: device guard",
            "backward op: conform q,k,v,dO, sink", "backward op: outputs", "backward op: workspace",
            "backward op: stream", "backward op: core execute"};
        static_assert(sizeof(names) / sizeof(names[0]) == kSteps, "a name for each step");
        auto line = [](const char *name, double us, int64_t calls) {  // steps no call reached: none
            if (calls == 0) return;
            std::fprintf(stderr, "fusedattn torch profile: %-36s %8.2f us/call (%lld calls)\n", name, us,
                         static_cast<long long>(calls));
        };
        for (int step = 0; step < kSteps; ++step) line(names[step], average_us(step), calls[step].load());
        // What no step covers: the dispatcher's work around each op with the op's return (the device
        // guard's restore, the workspace's release).
        line("= attention: the rest", average_us(kWhole) - average_us(kForwardCall) - average_us(kSave),
             calls[kWhole].load());
        line("= forward op: the rest (dispatch)", average_us(kForwardCall) - sum_us(kFwdPlan, kFwdExecute),
             calls[kForwardCall].load());
        line("= backward op: the rest (dispatch)", average_us(kBackwardCall) - sum_us(kBwdPlan, kBwdExecute),
             calls[kBackwardCall].load());
    }
};

StepTimes step_times;

// Times consecutive steps: mark(step) adds the time since the last mark (or since construction).
class Timer {
   public:
    Timer() {
        if (profiling) last_ = std::chrono::steady_clock::now();
    }
    void mark(Step step) {
        if (!profiling) return;
        auto now = std::chrono::steady_clock::now();
        step_times.nanoseconds[step] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
        step_times.calls[step] += 1;
        last_ = now;
    }

   private:
    std::chrono::steady_clock::time_point last_;
};

// What the operator needs of one configuration beyond its graphs. Shapes are those of the tensors
// the caller passes and gets (q, k, v in their base layout); strides are what the graphs were built
// for (an input with other strides is copied into them).
constexpr int kMaxDevices = 64;

struct TorchPlan {
    int64_t forward = -1, backward = -1;  // core plan ids; backward -1 for an inference configuration
    // Workspace bytes of each graph per device, once the core has deserialized it there (-1: not yet).
    std::atomic<int64_t> workspace[2][kMaxDevices];
    at::ScalarType dtype = at::kBFloat16;
    int64_t sink_kind = kNoSink;
    int64_t heads_q = 0;
    bool stats = false;  // the forward writes the LSE
    std::vector<int64_t> out_sizes, out_strides, lse_sizes;
    std::vector<int64_t> sizes[3], strides[3], grad_strides[3];  // q, k, v

    TorchPlan() {
        for (auto &pass : workspace) {
            for (auto &bytes : pass) bytes.store(-1, std::memory_order_relaxed);
        }
    }
};

fusedattn_native::Bounded<TorchPlan> &torch_plans() {
    static fusedattn_native::Bounded<TorchPlan> plans;
    return plans;
}

constexpr const char *kNotRegistered = "is not registered in this process";

std::shared_ptr<TorchPlan> find_plan(int64_t id) {
    auto plan = torch_plans().find(id);
    TORCH_CHECK(plan != nullptr, "fusedattn: native plan ", id, " ", kNotRegistered,
                " (evicted from the bounded registry, or traced in another process); call "
                "fusedattn.torch.attention again to register it");
    return plan;
}

// x with the strides the graph was built for: x itself when it has them (sizes-1 axes may differ).
Tensor conform(const Tensor &x, const std::vector<int64_t> &sizes, const std::vector<int64_t> &strides,
               const char *name) {
    TORCH_CHECK(x.sizes().equals(sizes), "fusedattn: ", name, ": expected shape ", c10::IntArrayRef(sizes),
                " (the registered plan's), got ", x.sizes());
    bool same = true;
    auto actual = x.strides();
    for (size_t i = 0; i < sizes.size(); ++i) same = same && (sizes[i] == 1 || actual[i] == strides[i]);
    if (same && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) return x;
    Tensor copy = at::empty_strided(sizes, strides, x.options());
    copy.copy_(x);
    return copy;
}

// Launches one pass (0 forward, 1 backward) with `count` slot pointers; `timer` marks its steps.
void launch(TorchPlan &owner, int pass, const c10::Device &device, void *const *slots, int64_t count,
            Timer &timer) {
    TORCH_CHECK(core().execute != nullptr, "fusedattn: the launch core is not loaded (fusedattn_torch_init)");
    TORCH_CHECK(device.index() >= 0 && device.index() < kMaxDevices, "fusedattn: device index ", device.index());
    int64_t plan = pass == 0 ? owner.forward : owner.backward;
    int64_t bytes = owner.workspace[pass][device.index()].load(std::memory_order_relaxed);
    if (bytes < 0) {  // the graph's workspace there, deserializing it once
        bytes = core().prepare(plan, device.index());
        TORCH_CHECK(bytes >= 0, "fusedattn: ", core().last_error());
        owner.workspace[pass][device.index()].store(bytes, std::memory_order_relaxed);
    }
    // Straight from the caching allocator, on the current stream: freed (for reuse in stream order) on return.
    c10::DataPtr workspace = bytes > 0 ? c10::GetAllocator(device.type())->allocate(bytes) : c10::DataPtr();
    timer.mark(pass == 0 ? kFwdWorkspace : kBwdWorkspace);
    const auto *impl = c10::impl::getDeviceGuardImpl(device.type());
    void *stream = impl->getStream(device).native_handle();
    timer.mark(pass == 0 ? kFwdStream : kBwdStream);
    int status = core().execute(plan, device.index(), stream, slots, count, workspace.get(), bytes);
    timer.mark(pass == 0 ? kFwdExecute : kBwdExecute);
    TORCH_CHECK(status == 0, "fusedattn: ", core().last_error());
}

// A new tensor on like's device. GPU tensors come from torch's caching allocator directly, as
// at::empty_strided's CUDA kernel makes them, without a trip through the dispatcher; meta ones from it.
Tensor new_tensor(c10::IntArrayRef sizes, c10::IntArrayRef strides, at::ScalarType dtype, const Tensor &like) {
    if (like.is_cuda()) {
        return at::detail::empty_strided_generic(sizes, strides, c10::GetAllocator(c10::DeviceType::CUDA),
                                                 c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype);
    }
    return at::empty_strided(sizes, strides, like.options().dtype(dtype));
}

Tensor new_dense(c10::IntArrayRef sizes, at::ScalarType dtype, const Tensor &like) {
    return new_tensor(sizes, c10::contiguous_strides(sizes), dtype, like);
}

void *pointer(const optional<Tensor> &x) { return x.has_value() && x->defined() ? x->data_ptr() : nullptr; }

Tensor sink_buffer(const TorchPlan &plan, const optional<Tensor> &sink, const Tensor &like) {
    if (plan.sink_kind == kLearnableSink) {
        TORCH_CHECK(sink.has_value() && sink->defined(), "fusedattn: this plan needs the sink logits");
        return sink->to(at::kFloat).contiguous();
    }
    if (plan.sink_kind == kZeroSink) return new_dense({1, plan.heads_q, 1, 1}, at::kFloat, like).zero_();
    return Tensor();
}

// The LSE is an empty tensor, not an undefined one, when the plan writes none: callers read its numel.
std::vector<Tensor> forward_outputs(const TorchPlan &plan, const Tensor &q) {
    std::vector<Tensor> outputs;
    outputs.reserve(2);
    outputs.push_back(new_tensor(plan.out_sizes, plan.out_strides, q.scalar_type(), q));
    outputs.push_back(new_dense(plan.stats ? c10::IntArrayRef(plan.lse_sizes) : c10::IntArrayRef({0}), at::kFloat,
                                q));
    return outputs;
}

std::vector<Tensor> forward_cuda(int64_t plan_id, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset) {
    Timer timer;
    auto plan = find_plan(plan_id);
    timer.mark(kFwdPlan);
    c10::DeviceGuard guard(q.device());
    timer.mark(kFwdGuard);
    Tensor qs = conform(q, plan->sizes[0], plan->strides[0], "q");
    Tensor ks = conform(k, plan->sizes[1], plan->strides[1], "k");
    Tensor vs = conform(v, plan->sizes[2], plan->strides[2], "v");
    Tensor sinks = sink_buffer(*plan, sink, q);
    timer.mark(kFwdInputs);
    auto outputs = forward_outputs(*plan, q);
    timer.mark(kFwdOutputs);
    std::array<void *, kForwardSlots> slots{};
    slots[kFwdQ] = qs.data_ptr();
    slots[kFwdK] = ks.data_ptr();
    slots[kFwdV] = vs.data_ptr();
    slots[kFwdSink] = sinks.defined() ? sinks.data_ptr() : nullptr;
    slots[kFwdSeed] = pointer(seed);
    slots[kFwdOffset] = pointer(offset);
    slots[kFwdO] = outputs[0].data_ptr();
    slots[kFwdStats] = plan->stats ? outputs[1].data_ptr() : nullptr;
    launch(*plan, 0, q.device(), slots.data(), slots.size(), timer);
    return outputs;
}

void check_shapes(const TorchPlan &plan, const Tensor &q, const Tensor &k, const Tensor &v) {
    const char *names[3] = {"q", "k", "v"};
    const Tensor *tensors[3] = {&q, &k, &v};
    for (int role = 0; role < 3; ++role) {
        TORCH_CHECK(tensors[role]->sizes().equals(plan.sizes[role]), "fusedattn: ", names[role], ": expected shape ",
                    c10::IntArrayRef(plan.sizes[role]), " (the registered plan's), got ", tensors[role]->sizes());
    }
}

std::vector<Tensor> forward_meta(int64_t plan_id, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset) {
    auto plan = find_plan(plan_id);
    check_shapes(*plan, q, k, v);
    return forward_outputs(*plan, q);
}

// dq, dk, dv, and dSink where the plan has sinks (the graph writes it for both kinds).
std::vector<Tensor> backward_outputs(const TorchPlan &plan, const Tensor &q) {
    std::vector<Tensor> grads;
    grads.reserve(4);
    for (int role = 0; role < 3; ++role) {
        grads.push_back(new_tensor(plan.sizes[role], plan.grad_strides[role], q.scalar_type(), q));
    }
    if (plan.sink_kind != kNoSink) grads.push_back(new_dense({1, plan.heads_q, 1, 1}, at::kFloat, q));
    return grads;
}

// cuDNN's backward has no term for a gradient reaching the LSE. One that is absent or all zeros (a
// compiled graph passes zeros for a returned LSE the loss does not use) changes nothing; any other is
// refused, in eager and compiled calls alike, at the cost of one host read in that case only. The text
// is the Python paths' (backends/base.py: no_lse_gradient).
void refuse_lse_gradient(const optional<Tensor> &grad_lse) {
    if (!grad_lse.has_value() || !grad_lse->defined()) return;
    TORCH_CHECK_NOT_IMPLEMENTED(!grad_lse->ne(0).any().item<bool>(),
                                "fusedattn.torch.attention: the cudnn backend has no gradient through the returned "
                                "lse; use backend='reference' for losses that depend on lse");
}

std::vector<Tensor> backward_cuda(int64_t plan_id, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &lse, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset) {
    Timer timer;
    auto plan = find_plan(plan_id);
    TORCH_CHECK(plan->backward >= 0, "fusedattn: native plan ", plan_id, " was registered for inference");
    timer.mark(kBwdPlan);
    refuse_lse_gradient(grad_lse);
    timer.mark(kBwdRefuse);
    c10::DeviceGuard guard(q.device());
    timer.mark(kBwdGuard);
    Tensor qs = conform(q, plan->sizes[0], plan->strides[0], "q");
    Tensor ks = conform(k, plan->sizes[1], plan->strides[1], "k");
    Tensor vs = conform(v, plan->sizes[2], plan->strides[2], "v");
    Tensor dout = conform(grad_out, plan->out_sizes, plan->out_strides, "grad_out");
    Tensor sinks = sink_buffer(*plan, sink, q);
    timer.mark(kBwdInputs);
    auto grads = backward_outputs(*plan, q);
    timer.mark(kBwdOutputs);
    std::array<void *, kBackwardSlots> slots{};
    slots[kBwdQ] = qs.data_ptr();
    slots[kBwdK] = ks.data_ptr();
    slots[kBwdV] = vs.data_ptr();
    slots[kBwdO] = out.data_ptr();
    slots[kBwdDO] = dout.data_ptr();
    slots[kBwdStats] = lse.data_ptr();
    slots[kBwdSink] = sinks.defined() ? sinks.data_ptr() : nullptr;
    slots[kBwdSeed] = pointer(seed);
    slots[kBwdOffset] = pointer(offset);
    slots[kBwdDQ] = grads[0].data_ptr();
    slots[kBwdDK] = grads[1].data_ptr();
    slots[kBwdDV] = grads[2].data_ptr();
    slots[kBwdDSink] = grads.size() > 3 ? grads[3].data_ptr() : nullptr;
    launch(*plan, 1, q.device(), slots.data(), slots.size(), timer);
    return grads;
}

std::vector<Tensor> backward_meta(int64_t plan_id, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &lse, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset) {
    auto plan = find_plan(plan_id);
    check_shapes(*plan, q, k, v);
    return backward_outputs(*plan, q);
}

std::vector<Tensor> call_forward(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::forward", "")
                         .typed<decltype(forward_cuda)>();
    return op.call(plan, q, k, v, sink, seed, offset);
}

std::vector<Tensor> call_backward(int64_t plan, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &lse, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::backward", "")
                         .typed<decltype(backward_cuda)>();
    return op.call(plan, grad_out, grad_lse, q, k, v, out, lse, sink, seed, offset);
}

Tensor defined_or_empty(const optional<Tensor> &x) { return x.has_value() ? *x : Tensor(); }

optional<Tensor> as_optional(const Tensor &x) { return x.defined() ? optional<Tensor>(x) : c10::nullopt; }

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The autograd node of one attention call, made as torch's generated code makes those of its own ops
// (lighter than a custom autograd Function): it saves what the backward op reads and calls it.
struct AttentionBackward : public torch::autograd::Node {
    int64_t plan = -1;
    SavedVariable q, k, v, out, lse, sink, seed, offset;

    std::string name() const override { return "FusedAttentionBackward"; }

    void release_variables() override {
        for (auto *saved : {&q, &k, &v, &out, &lse, &sink, &seed, &offset}) saved->reset_data();
    }

    // grads: of out and lse (either undefined when unused); returns those of q, k, v and sink.
    variable_list apply(variable_list &&grads) override {
        Timer timer;
        auto self = getptr();
        Tensor outs = out.unpack(self);
        Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(outs);
        Tensor sinks = sink.unpack(self);
        timer.mark(kSaved);
        auto result = call_backward(plan, grad_out, as_optional(grads[1]), q.unpack(self), k.unpack(self),
                                    v.unpack(self), outs, lse.unpack(self), as_optional(sinks),
                                    as_optional(seed.unpack(self)), as_optional(offset.unpack(self)));
        timer.mark(kBackwardCall);
        variable_list gradients(4);
        for (int role = 0; role < 3; ++role) gradients[role] = std::move(result[role]);
        if (sinks.defined() && result.size() > 3) {  // learnable sinks only: an off-by-one sink is no input
            gradients[3] = result[3].reshape({-1}).to(sinks.scalar_type());
        }
        timer.mark(kGradients);
        return gradients;
    }
};

// Nodes are held by std::shared_ptr up to torch 2.12 and by c10::intrusive_ptr after: make ours as
// this torch's edges hold them.
using NodePointer = decltype(torch::autograd::Edge().function);

// (Partial specializations: only the one this torch's pointer type picks is instantiated.)
template <class Pointer, class T>
struct NodeMaker;
template <class T>
struct NodeMaker<std::shared_ptr<torch::autograd::Node>, T> {
    static std::shared_ptr<T> make() { return std::make_shared<T>(); }
};
template <class T>
struct NodeMaker<c10::intrusive_ptr<torch::autograd::Node>, T> {
    static c10::intrusive_ptr<T> make() { return c10::make_intrusive<T>(); }
};

bool requires_grad(const optional<Tensor> &x) { return x.has_value() && x->defined() && x->requires_grad(); }

std::vector<Tensor> attention_autograd(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                       const optional<Tensor> &sink, const optional<Tensor> &seed,
                                       const optional<Tensor> &offset) {
    Timer whole;
    bool differentiable = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() ||
                                                         v.requires_grad() || requires_grad(sink));
    std::vector<Tensor> outputs;
    {
        at::AutoDispatchBelowADInplaceOrView below;
        Timer timer;
        outputs = call_forward(plan, q, k, v, sink, seed, offset);
        timer.mark(kForwardCall);
    }
    if (differentiable) {
        Timer timer;
        auto node = NodeMaker<NodePointer, AttentionBackward>::make();
        Tensor sinks = defined_or_empty(sink);
        node->set_next_edges(torch::autograd::collect_next_edges(q, k, v, sinks));
        node->plan = plan;
        NodePointer base = node;
        torch::autograd::set_history(outputs[0], base);
        torch::autograd::set_history(outputs[1], base);
        node->q = SavedVariable(q, false);
        node->k = SavedVariable(k, false);
        node->v = SavedVariable(v, false);
        node->sink = SavedVariable(sinks, false);
        node->seed = SavedVariable(defined_or_empty(seed), false);
        node->offset = SavedVariable(defined_or_empty(offset), false);
        node->out = SavedVariable(outputs[0], true);
        node->lse = SavedVariable(outputs[1], true);
        timer.mark(kSave);
    }
    whole.mark(kWhole);
    return outputs;
}

}  // namespace

TORCH_LIBRARY(fusedattn_native, m) {
    m.def("attention(int plan, Tensor q, Tensor k, Tensor v, Tensor? sink, Tensor? seed, Tensor? offset) "
          "-> Tensor[]");
    m.def("forward(int plan, Tensor q, Tensor k, Tensor v, Tensor? sink, Tensor? seed, Tensor? offset) -> Tensor[]");
    m.def("backward(int plan, Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
          "Tensor lse, Tensor? sink, Tensor? seed, Tensor? offset) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(fusedattn_native, Autograd, m) { m.impl("attention", &attention_autograd); }
TORCH_LIBRARY_IMPL(fusedattn_native, CUDA, m) {
    m.impl("attention", &attention_autograd);
    m.impl("forward", &forward_cuda);
    m.impl("backward", &backward_cuda);
}
TORCH_LIBRARY_IMPL(fusedattn_native, Meta, m) {
    m.impl("attention", &attention_autograd);
    m.impl("forward", &forward_meta);
    m.impl("backward", &backward_meta);
}

#ifdef FUSEDATTN_PYTHON_ENTRY
// A Python function calling the operator through the dispatcher, typed: the warm path's way in when the
// library is built with Python's headers. It costs less than torch.ops' boxed call, which converts
// each argument through the schema; autograd, capture and every dispatch key still apply.
#include <torch/csrc/utils/pybind.h>

namespace {

std::tuple<Tensor, Tensor> call_attention(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                          const optional<Tensor> &sink, const optional<Tensor> &seed,
                                          const optional<Tensor> &offset) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::attention", "")
                         .typed<decltype(attention_autograd)>();
    auto outputs = op.call(plan, q, k, v, sink, seed, offset);
    return {outputs[0], outputs[1]};
}

}  // namespace

// torch's errors as torch.ops raises them: its Python types, without the C++ backtrace.
void translate_error(std::exception_ptr error) {
    auto raise = [](PyObject *type, const c10::Error &e) { PyErr_SetString(type, e.what_without_backtrace()); };
    try {
        if (error) std::rethrow_exception(error);
    } catch (const c10::OutOfMemoryError &e) {
        raise(pybind11::module_::import("torch").attr("OutOfMemoryError").ptr(), e);
    } catch (const c10::NotImplementedError &e) {
        raise(PyExc_NotImplementedError, e);
    } catch (const c10::ValueError &e) {
        raise(PyExc_ValueError, e);
    } catch (const c10::TypeError &e) {
        raise(PyExc_TypeError, e);
    } catch (const c10::IndexError &e) {
        raise(PyExc_IndexError, e);
    } catch (const c10::Error &e) {
        raise(PyExc_RuntimeError, e);
    }
}

PYBIND11_MODULE(libfusedattn_torch, m) {
    pybind11::register_local_exception_translator(&translate_error);
    m.def("attention", &call_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
}
#endif

// The library's exports besides the operator registration (built with hidden visibility).
#pragma GCC visibility push(default)

extern "C" {

static thread_local std::string fusedattn_error;

const char *fusedattn_torch_last_error() { return fusedattn_error.c_str(); }

// Finds the launch core's functions in the library at `core_path` (already loaded by Python). 0 on success.
int fusedattn_torch_init(const char *core_path) {
    fusedattn_error = fusedattn_native::load_core(core_path, &core());
    return fusedattn_error.empty() ? 0 : 1;
}

// A torch plan from two core plans (backward -1 for inference) and its shapes, flattened:
// dtype code (c10::ScalarType), sink kind, Hq, stats, out sizes[4], out strides[4], lse sizes[3],
// then for q, k, v: sizes[4], strides[4], gradient strides[4]. Its id, or -1.
int64_t fusedattn_torch_plan(int64_t forward, int64_t backward, const int64_t *shape, int64_t count) {
    constexpr int64_t kCount = 4 + 4 + 4 + 3 + 3 * 12;
    if (count != kCount) {
        fusedattn_error = "expected " + std::to_string(kCount) + " shape entries, got " + std::to_string(count);
        return -1;
    }
    auto plan = std::make_shared<TorchPlan>();
    plan->forward = forward;
    plan->backward = backward;
    const int64_t *next = shape;
    auto take = [&next](int64_t n) {
        std::vector<int64_t> values(next, next + n);
        next += n;
        return values;
    };
    plan->dtype = static_cast<at::ScalarType>(*next++);
    plan->sink_kind = *next++;
    plan->heads_q = *next++;
    plan->stats = *next++ != 0;
    plan->out_sizes = take(4);
    plan->out_strides = take(4);
    plan->lse_sizes = take(3);
    for (int role = 0; role < 3; ++role) {
        plan->sizes[role] = take(4);
        plan->strides[role] = take(4);
        plan->grad_strides[role] = take(4);
    }
    return torch_plans().add(plan);
}

// Sets the torch plans' bound (when capacity > 0); the number of plans held.
int64_t fusedattn_torch_bounds(int64_t capacity) {
    if (capacity > 0) torch_plans().set_capacity(capacity);
    return torch_plans().size();
}

}  // extern "C"

#pragma GCC visibility pop
