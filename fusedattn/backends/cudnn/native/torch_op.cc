// fusedattn's cuDNN attention as a torch operator with its autograd in C++: the warm path.
//
// Python validates a call, selects the backend, builds and serializes the forward and backward
// graphs and registers them here once per configuration (a "torch plan": the two graphs plus the
// shapes and strides of every tensor the call reads and writes). A repeat call is then one
// operator call: torch.ops.fusedattn_native.attention(plan, q, k, v, sink, seed, offset, bias, aux,
// scalars, empty_rows). bias: a bias tensor (its gradient too where the plan has one); aux and
// scalars: a score_mod's aux tensors and pass-by-value numbers, in the plan's order; empty_rows:
// rows a score_mod left without a visible key get output 0 and LSE -inf, as the Python path gives
// them. Its autograd kernel saves what the backward needs; forward and backward allocate their
// outputs from torch's caching allocator and launch the deserialized graph on torch's current stream.
// Meta kernels give the output shapes from the plan, so torch.compile traces the same operator.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <unordered_map>

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
#include "triton_launch.h"

namespace {

using at::Tensor;
using c10::optional;

// The launch core (launch_core.cc), a separate library with its own copy of the cuDNN frontend:
// its C functions, found when Python calls fusedattn_torch_init with its path.
fusedattn_native::CoreApi &core() {
    static fusedattn_native::CoreApi functions;
    return functions;
}

// Slot orders of the two graphs: Python registers each graph's uids in these orders, followed by the
// plan's aux tensors and then its scalars (torch_plans.py: FORWARD_SLOTS, BACKWARD_SLOTS).
// Each ends in the sequence slots of padded and THD graphs (lengths, then ragged offsets), which point
// into the call's sequence table at the rows the plan gives.
constexpr int kForwardSequenceSlots = 9, kBackwardSequenceSlots = 12;
enum ForwardSlot {
    kFwdQ, kFwdK, kFwdV, kFwdSink, kFwdSeed, kFwdOffset, kFwdO, kFwdStats, kFwdBias, kFwdRowMax, kFwdSumExp,
    kFwdSequences,
    kForwardSlots = kFwdSequences + kForwardSequenceSlots
};
enum BackwardSlot {
    kBwdQ, kBwdK, kBwdV, kBwdO, kBwdDO, kBwdStats, kBwdSink, kBwdSeed, kBwdOffset,
    kBwdDQ, kBwdDK, kBwdDV, kBwdDSink, kBwdBias, kBwdDBias, kBwdSequences,
    kBackwardSlots = kBwdSequences + kBackwardSequenceSlots
};
// The Triton kernels around a padded or THD graph (sequence_kernels.py), in sequence_plans.KERNELS' order.
enum SequenceKernel { kTableKernel, kFixForward, kFixBackwardQ, kFixBackwardKV, kSequenceKernels };
enum SinkKind { kNoSink = 0, kZeroSink = 1, kLearnableSink = 2 };
enum BiasKind { kNoBias = 0, kPostScaleBias = 1, kPreScaleBias = 2 };
enum ScalarType { kFloat32Scalar = 0, kInt32Scalar = 1 };
// A score the score_mod graph masked reads at most this (score_mods/core.py: MASKED_BELOW).
constexpr double kMaskedBelow = -1.0e8;

// FUSEDATTN_NATIVE_PROFILE=1 (the launch core reads it too): the operator's host time by step,
// averaged over the calls that reach each step, on stderr at exit. Off, a step costs one branch.
enum Step {
    kWhole, kForwardCall, kSave,  // the autograd kernel: all of it, its forward op, its node and saving
    kFwdPlan, kFwdGuard, kFwdInputs, kFwdTable, kFwdOutputs, kFwdWorkspace, kFwdStream, kFwdExecute, kFwdAfter,
    kSaved, kBackwardCall, kGradients,  // AttentionBackward::apply
    kBwdPlan, kBwdRefuse, kBwdGuard, kBwdInputs, kBwdOutputs, kBwdWorkspace, kBwdStream, kBwdExecute, kBwdAfter,
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
            "forward: find_plan", "forward: device guard", "forward: conform q,k,v, sink", "forward: sequence table",
            "forward: outputs", "forward: workspace", "forward: stream", "forward: core execute",
            "forward: after execute (LSE, fix-ups)",
            "backward: saved variables", "backward: backward op", "backward: gradients out",
            "backward op: find_plan", "backward op: refuse lse grad", "backward op: device guard",
            "backward op: conform q,k,v,dO, sink", "backward op: outputs", "backward op: workspace",
            "backward op: stream", "backward op: core execute",
            "backward op: after execute (fix-ups, dBias)"};
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
        line("= forward op: the rest (dispatch)", average_us(kForwardCall) - sum_us(kFwdPlan, kFwdAfter),
             calls[kForwardCall].load());
        line("= backward op: the rest (dispatch)", average_us(kBackwardCall) - sum_us(kBwdPlan, kBwdAfter),
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

// What a padded or THD plan adds (sequence_plans.py): the sequence table's shape, the rows its graph
// slots read, the units of the ragged offsets, and the compiled kernels that build the table before
// the graph and fix the rows cuDNN leaves after it.
struct SequencePlan {
    bool ragged = false;          // THD: q, k, v, out are (T, H, D) tokens
    bool padded_offsets = false;  // cu_seqlens_*_padded given: four offset tensors, not two
    int64_t batch = 0, width = 0, rows = 0, flag_row = 0, limit_q = 0, limit_kv = 0, seqlen_q = 0, seqlen_kv = 0;
    int64_t rows_per_program = 16;  // query or key rows each fix-up program visits
    int64_t table_programs = 1;     // the table kernel's; 1 + B where the table holds a score_mod's penalties
    std::vector<int64_t> units, sides;  // per ragged offset: elements per token, side (0 queries, 1 keys)
    std::vector<int64_t> forward_rows, backward_rows;  // the table row of each sequence slot, -1: unbound
    std::unique_ptr<fusedattn_native::TritonKernel> kernels[kSequenceKernels];

    // A score_mod graph's: its padding is the table's penalties (sequence_layout.Layout.penalty_rows).
    bool score_mod() const { return table_programs > 1; }
};

struct TorchPlan {
    int64_t forward = -1, backward = -1;  // core plan ids; backward -1 for an inference configuration
    // Workspace bytes of each graph per device, once the core has deserialized it there (-1: not yet).
    std::atomic<int64_t> workspace[2][kMaxDevices];
    at::ScalarType dtype = at::kBFloat16;
    int64_t sink_kind = kNoSink;
    int64_t heads_q = 0;
    bool stats = false;  // the forward writes the LSE
    bool max_logit = false;  // the forward writes row maxima and sums of exp instead (return_max_logit)
    std::vector<int64_t> out_sizes, out_strides, lse_sizes;
    std::vector<int64_t> sizes[3], strides[3], grad_strides[3];  // q, k, v
    std::vector<int64_t> to_bhsd;  // the permutation taking out to (B, H, S, D)
    int64_t bias_kind = kNoBias;
    double scale = 1.0;        // a pre-scale bias is multiplied by it (and so is its gradient)
    std::vector<int64_t> bias_shape;  // the config's (b, h, sq, skv): sq, skv 1 where it broadcasts
    std::vector<int64_t> bias_dims;   // the graph's (b, h, Sq, Skv): dBias has these sizes, dense
    bool bias_grad = false;    // the backward writes dBias
    int64_t aux_count = 0;     // score_mod aux tensors, bound after the graph's own slots
    std::vector<int64_t> scalar_types;  // score_mod scalars (ScalarType), bound after the aux tensors
    std::shared_ptr<SequencePlan> sequences;  // padded and THD plans only
    // A score_mod plan's kernel for rows left without keys (backends/cudnn/empty_rows_kernel.py), and the
    // LSE rows each of its programs visits; without one, clear_empty_rows runs torch ops.
    std::unique_ptr<fusedattn_native::TritonKernel> empty_rows;
    int64_t empty_rows_per_program = 0;

    bool ragged() const { return sequences != nullptr && sequences->ragged; }
    // Whether a training forward returns the stats its backward reads apart from the LSE: +inf for rows a
    // score_mod emptied (and, with sequences, for every row whose LSE is -inf), or the padded graph's own
    // (the LSE is -inf past each sequence's end).
    bool separate_stats(bool empty_rows) const {
        return backward >= 0 &&
               (empty_rows || (sequences != nullptr && (!sequences->ragged || sequences->score_mod())));
    }

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

// x's memory seen with other sizes and strides, made as new_tensor makes tensors: no dispatcher trip and
// no autograd record, what a view op below autograd gives (a document call makes about 16 such views a
// step). Plain tensors only: a tensor subclass or wrapper takes the view op.
Tensor restrided(const Tensor &x, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
    c10::TensorImpl *impl = x.unsafeGetTensorImpl();
    if (typeid(*impl) != typeid(c10::TensorImpl) || !impl->has_storage() ||
        x.key_set().has(c10::DispatchKey::Python)) {
        at::AutoDispatchBelowADInplaceOrView below;
        return x.as_strided(sizes, strides);
    }
    Tensor view = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(x.storage()),
                                                           x.key_set(), x.dtype());
    view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, x.storage_offset());
    return view;
}

// x, dense, seen with other sizes of the same count.
Tensor dense_as(const Tensor &x, c10::IntArrayRef sizes) {
    if (!x.is_contiguous()) {
        at::AutoDispatchBelowADInplaceOrView below;
        return x.view(sizes);
    }
    return restrided(x, sizes, c10::contiguous_strides(sizes));
}

void *pointer(const optional<Tensor> &x) { return x.has_value() && x->defined() ? x->data_ptr() : nullptr; }

// x itself where cuDNN can read it (dense, its address a multiple of 16 bytes), else a copy that is.
Tensor dense_aligned(const Tensor &x) {
    Tensor dense = x.contiguous();
    if (reinterpret_cast<uintptr_t>(dense.data_ptr()) % 16 == 0) return dense;
    return dense.clone(at::MemoryFormat::Contiguous);  // fresh memory from the allocator is aligned
}

// A THD tensor (T, H, D) with the token and head strides the graph reads (the plan's sizes and
// strides are in (B, S, H, D) order): x itself when it has them, else a copy that does.
void check_tokens(const Tensor &x, const std::vector<int64_t> &sizes, const char *name) {
    TORCH_CHECK(x.dim() == 3 && x.size(1) == sizes[2] && x.size(2) == sizes[3], "fusedattn: ", name,
                ": expected a THD tensor (T, ", sizes[2], ", ", sizes[3], ") (the registered plan's), got ",
                x.sizes());
}

Tensor tokens(const Tensor &x, const std::vector<int64_t> &sizes, const std::vector<int64_t> &strides,
              const char *name) {
    check_tokens(x, sizes, name);
    return conform(x, {x.size(0), sizes[2], sizes[3]}, {strides[1], strides[2], strides[3]}, name);
}

void *current_stream(const c10::Device &device) {
    return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

uint64_t word(const Tensor &x) { return reinterpret_cast<uint64_t>(x.data_ptr()); }
uint64_t word(int64_t x) { return static_cast<uint64_t>(x); }
uint64_t word(float x) {
    uint64_t bits = 0;
    std::memcpy(&bits, &x, sizeof(x));
    return bits;
}

void launch_kernel(const SequencePlan &plan, SequenceKernel which, const Tensor &like, int64_t blocks,
                   std::vector<uint64_t> &words) {
    auto &kernel = plan.kernels[which];
    TORCH_CHECK(kernel != nullptr, "fusedattn: this plan's sequence kernels were not registered");
    std::string error = kernel->launch(like.device().index(), current_stream(like.device()), blocks, words);
    TORCH_CHECK(error.empty(), "fusedattn: ", error);
}

// Tensors known by identity, held weakly (a weak reference keeps the object's address from being reused,
// so an address names one tensor while it is held), at most `capacity` of them: the first added go first.
class WeakTensorSet {
   public:
    using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
    explicit WeakTensorSet(size_t capacity) : capacity_(capacity) {}

    void add(const Tensor &x) {
        std::lock_guard<std::mutex> lock(mutex_);
        const c10::TensorImpl *impl = x.unsafeGetTensorImpl();
        if (held_.count(impl) != 0) return;
        if (order_.size() >= capacity_) {
            held_.erase(order_.front());
            order_.pop_front();
        }
        held_.emplace(impl, Weak(x.getIntrusivePtr()));
        order_.push_back(impl);
    }

    bool contains(const Tensor &x) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = held_.find(x.unsafeGetTensorImpl());
        return found != held_.end() && !found->second.expired();
    }

   private:
    size_t capacity_;
    std::mutex mutex_;
    std::unordered_map<const c10::TensorImpl *, Weak> held_;
    std::deque<const c10::TensorImpl *> order_;
};

// Offsets this library made for a document mask (torch/documents.py): every sequence non-empty, together
// covering every token. A THD call given one of them as both cu_seqlens (no padded offsets) leaves no row
// for the fix-up kernels (none outside a sequence, none whose other side is empty, none broken), so its
// forward and backward skip them (about 4 us of host time each); its tables are kept here for the backward.
WeakTensorSet &tiling_offsets() {
    static WeakTensorSet offsets(64);
    return offsets;
}
WeakTensorSet &tiling_tables() {  // one per forward whose backward may come: the layers of a step, and more
    static WeakTensorSet tables(1024);
    return tables;
}

bool tiles_every_token(const SequencePlan &plan, at::TensorList offsets, int64_t tokens_q, int64_t tokens_kv) {
    return plan.ragged && !plan.padded_offsets && tokens_q == tokens_kv && offsets.size() == 2 &&
           offsets[0].is_same(offsets[1]) && tiling_offsets().contains(offsets[0]);
}

// The sequence tables of tiling offsets, kept for the next call of the same layout (about 5 us of host
// time a call: an allocation and the table kernel's launch). Such offsets are made once per document
// layout and never written, so their table is the same at every call. Keyed by the offsets (held weakly),
// the plan's sequences (held, so the address names one plan), the token count, the device and the stream
// the table was written on (read in that stream's order only). Only the eager operator keeps them, and not
// while its stream is captured: a graph would go on reading a table this cache may drop; and torch.compile's
// forward op returns the table as an output, which must be its own.
class KeptTables {
   public:
    struct Key {
        const c10::TensorImpl *offsets;
        const SequencePlan *sequences;
        int64_t tokens, device;
        void *stream;
        bool operator==(const Key &o) const {
            return offsets == o.offsets && sequences == o.sequences && tokens == o.tokens && device == o.device &&
                   stream == o.stream;
        }
    };

    Tensor find(const Key &key) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const Kept &kept : kept_) {
            if (kept.key == key) return kept.offsets.expired() ? Tensor() : kept.table;
        }
        return Tensor();
    }

    void add(const Key &key, const Tensor &offsets, std::shared_ptr<SequencePlan> sequences, const Tensor &table) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = kept_.begin(); it != kept_.end(); ++it) {
            if (it->key == key) {  // (its offsets were dropped and the address came back: held weakly no more)
                kept_.erase(it);
                break;
            }
        }
        if (kept_.size() >= kCapacity) kept_.pop_front();
        kept_.push_back({key, Weak(offsets.getIntrusivePtr()), std::move(sequences), table});
    }

   private:
    using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
    struct Kept {
        Key key;
        Weak offsets;
        std::shared_ptr<SequencePlan> sequences;
        Tensor table;
    };
    static constexpr size_t kCapacity = 32;  // a model's document layouts at a time: one per batch
    std::mutex mutex_;
    std::deque<Kept> kept_;
};

KeptTables &kept_tables() {
    static KeptTables tables;
    return tables;
}

// Set by the eager operator around its forward op: that forward may hand out a kept table (KeptTables).
thread_local bool eager_forward = false;
struct EagerForward {
    EagerForward() { eager_forward = true; }
    ~EagerForward() { eager_forward = false; }
};

// cu_seqlens as the table kernel reads them: int32 on q's device (a copy only where they are not).
Tensor as_offsets(const Tensor &x, const Tensor &like, int64_t batch, const char *name) {
    TORCH_CHECK(x.dim() == 1 && x.size(0) == batch + 1, "fusedattn: ", name, ": expected ", batch + 1,
                " offsets (the registered plan's batch + 1), got shape ", x.sizes());
    return x.to(like.device(), at::kInt).contiguous();
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// The call's sequence table (sequences.py: SequenceTable): lengths, ragged offsets and the offsets'
// check, written on the device by one kernel. offsets: cu_seqlens_q, cu_seqlens_kv, then the padded
// offsets where the plan takes them. tokens_*: THD tensors' token counts (0 for padded layouts).
// run: false in the meta kernels, which check the offsets and shape the table only.
Tensor sequence_table(const SequencePlan &plan, at::TensorList offsets, int64_t tokens_q, int64_t tokens_kv,
                      const Tensor &q, bool run = true) {
    size_t expected = plan.padded_offsets ? 4 : 2;
    TORCH_CHECK(offsets.size() == expected, "fusedattn: this plan takes ", expected, " offset tensors, got ",
                offsets.size());
    for (size_t i = 0; i < plan.units.size(); ++i) {  // cuDNN's ragged offsets are int32 element offsets
        int64_t tokens = plan.sides[i] == 0 ? tokens_q : tokens_kv;
        TORCH_CHECK_VALUE(tokens * plan.units[i] <= kInt32Max, "fusedattn: cudnn: THD offsets reach ", tokens,
                          " tokens x ", plan.units[i], " elements, past cuDNN's int32 ragged offsets (", kInt32Max,
                          "); split the packed batch, or use backend='reference'");
    }
    Tensor cu_q = as_offsets(offsets[0], q, plan.batch, "cu_seqlens_q");
    Tensor cu_kv = as_offsets(offsets[1], q, plan.batch, "cu_seqlens_kv");
    Tensor starts_q = plan.padded_offsets ? as_offsets(offsets[2], q, plan.batch, "cu_seqlens_q_padded") : cu_q;
    Tensor starts_kv = plan.padded_offsets ? as_offsets(offsets[3], q, plan.batch, "cu_seqlens_kv_padded") : cu_kv;
    Tensor table = new_dense({plan.rows, plan.width}, at::kInt, q);
    if (!run) return table;
    std::vector<uint64_t> words = {word(cu_q), word(cu_kv), word(starts_q), word(starts_kv), word(table),
                                   word(plan.batch), word(plan.limit_q), word(plan.limit_kv), word(tokens_q),
                                   word(tokens_kv), word(plan.width)};
    launch_kernel(plan, kTableKernel, q, plan.table_programs, words);
    return table;
}

// The graph slots that read the table: each sequence slot's row, or nullptr where the graph has none.
void bind_table(const std::vector<int64_t> &rows, const SequencePlan &plan, const Tensor &table, void **slots) {
    for (size_t i = 0; i < rows.size(); ++i) {
        slots[i] = rows[i] < 0 ? nullptr : static_cast<char *>(table.data_ptr()) + rows[i] * plan.width * 4;
    }
}

// The (b, s, h) strides of a fix-up view: (B, S, H[, D]) padded, (T, H[, D]) THD (no batch stride).
std::array<int64_t, 3> row_strides(const SequencePlan &plan, const Tensor &x) {
    if (plan.ragged) return {0, x.stride(0), x.stride(1)};
    return {x.stride(0), x.stride(1), x.stride(2)};
}

// Writes the rows of one side that cuDNN leaves (sequence_kernels.py: fix_rows). x, y: that side's
// outputs or gradients as (B, S, H, D) views (THD: (T, H, D)); lse, stats: the forward's (B, S, H)
// views (THD: (T, H)); sink: the learnable sink logits, where the plan has them; bstats: where the kernel
// was compiled to write a score_mod backward's stats (strided as lse), their tensor.
void fix_rows(const SequencePlan &plan, SequenceKernel which, const Tensor &table, const Tensor &x,
              const Tensor &y, const Tensor &lse, const Tensor &stats, const Tensor &sink, int64_t seqlen,
              const Tensor &bstats = Tensor()) {
    int64_t rows = plan.ragged ? x.size(0) : x.size(0) * x.size(1);
    if (rows == 0) return;
    const Tensor &second = y.defined() ? y : x;
    auto sx = row_strides(plan, x), sy = row_strides(plan, second);
    // The kernels were compiled to store 16 bytes at once (sequence_plans.py: _FIX_DIVISIBILITY).
    for (const Tensor *t : {&x, &second}) {
        auto strides = row_strides(plan, *t);
        bool aligned = reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 && t->size(-1) % 8 == 0;
        for (int64_t stride : strides) aligned = aligned && stride % 8 == 0;
        TORCH_CHECK(aligned, "fusedattn: internal: a fix-up's rows are not 16-byte aligned (sizes ", t->sizes(),
                    ", strides ", t->strides(), "); please report this");
    }
    std::array<int64_t, 3> sl = lse.defined() ? row_strides(plan, lse) : std::array<int64_t, 3>{0, 0, 0};
    float gap_lse = plan.ragged ? 0.0f : -std::numeric_limits<float>::infinity();
    std::vector<uint64_t> words = {
        word(x), word(second), word(lse.defined() ? lse : x), word(stats.defined() ? stats : x),
        word(sink.defined() ? sink : x), word(bstats.defined() ? bstats : x), word(table), word(plan.width),
        word(plan.batch), word(rows),
        word(plan.ragged ? int64_t(1) : seqlen), word(x.size(-2)), word(x.size(-1)), word(second.size(-1)),
        word(gap_lse), word(sx[0]), word(sx[1]), word(sx[2]), word(sy[0]), word(sy[1]), word(sy[2]),
        word(sl[0]), word(sl[1]), word(sl[2])};
    launch_kernel(plan, which, x, (rows + plan.rows_per_program - 1) / plan.rows_per_program, words);
}

// NaN where the call's offsets broke the rules, as fix_rows makes q, k and v's gradients then.
Tensor poisoned(const SequencePlan &plan, const Tensor &table, const Tensor &grad) {
    Tensor broken = table.select(0, plan.flag_row).narrow(0, 0, 1).ne(0);
    return grad.masked_fill(broken, std::numeric_limits<double>::quiet_NaN());
}

// (B, S, H, D) view of a tensor in the caller's layout.
Tensor bshd(const TorchPlan &plan, const Tensor &x) { return x.permute(plan.to_bhsd).permute({0, 2, 1, 3}); }

Tensor sink_buffer(const TorchPlan &plan, const optional<Tensor> &sink, const Tensor &like) {
    if (plan.sink_kind == kLearnableSink) {
        TORCH_CHECK(sink.has_value() && sink->defined(), "fusedattn: this plan needs the sink logits");
        return dense_aligned(sink->to(at::kFloat));
    }
    if (plan.sink_kind == kZeroSink) return new_dense({1, plan.heads_q, 1, 1}, at::kFloat, like).zero_();
    return Tensor();
}

// The bias as the graph reads it: q's dtype, pre-scaled where the plan says, dense in its own
// (broadcast) shape, whose elements the graph reads through its broadcast strides.
Tensor bias_buffer(const TorchPlan &plan, const optional<Tensor> &bias, const Tensor &like) {
    if (plan.bias_kind == kNoBias) return Tensor();
    TORCH_CHECK(bias.has_value() && bias->defined(), "fusedattn: this plan needs the bias");
    TORCH_CHECK(bias->numel() == c10::multiply_integers(plan.bias_shape), "fusedattn: bias: expected ",
                c10::IntArrayRef(plan.bias_shape), " elements' worth (the registered plan's), got shape ",
                bias->sizes());
    Tensor buffer = bias->to(like.scalar_type());
    if (plan.bias_kind == kPreScaleBias) buffer = buffer.mul(plan.scale);  // (qk + b) * s == qk * s + b * s
    return dense_aligned(buffer);
}

// A call's score_mod operands: aux tensors as they are (Python made them with the strides the graph was
// built for) and scalars as 4-byte host values, which cuDNN reads when the graph is launched.
struct ScoreModOperands {
    std::vector<void *> pointers;
    std::vector<uint32_t> words;

    // The counts the plan takes (meta implementations check only these: fake tensors have no data).
    static void check(const TorchPlan &plan, at::TensorList aux, c10::ArrayRef<double> scalars) {
        TORCH_CHECK(static_cast<int64_t>(aux.size()) == plan.aux_count, "fusedattn: expected ", plan.aux_count,
                    " score_mod aux tensors (the registered plan's), got ", aux.size());
        TORCH_CHECK(scalars.size() == plan.scalar_types.size(), "fusedattn: expected ", plan.scalar_types.size(),
                    " score_mod scalars (the registered plan's), got ", scalars.size());
    }

    ScoreModOperands(const TorchPlan &plan, at::TensorList aux, c10::ArrayRef<double> scalars) {
        check(plan, aux, scalars);
        words.resize(scalars.size());
        for (size_t i = 0; i < scalars.size(); ++i) {
            if (plan.scalar_types[i] == kInt32Scalar) {
                int32_t value = static_cast<int32_t>(scalars[i]);
                std::memcpy(&words[i], &value, sizeof(value));
            } else {
                float value = static_cast<float>(scalars[i]);
                std::memcpy(&words[i], &value, sizeof(value));
            }
        }
        pointers.reserve(aux.size() + scalars.size());
        for (const Tensor &x : aux) pointers.push_back(x.data_ptr());
        for (auto &word : words) pointers.push_back(&word);
    }
};

// x as the graph reads it: with the plan's strides, as THD tokens for a THD plan.
Tensor conform_input(const TorchPlan &plan, const Tensor &x, const std::vector<int64_t> &sizes,
                     const std::vector<int64_t> &strides, const char *name) {
    return plan.ragged() ? tokens(x, sizes, strides, name) : conform(x, sizes, strides, name);
}

// What both passes read besides their own tensors, as the graphs read it.
struct PassInputs {
    Tensor q, k, v, sinks, biases;
    ScoreModOperands operands;

    PassInputs(const TorchPlan &plan, const Tensor &q_in, const Tensor &k_in, const Tensor &v_in,
               const optional<Tensor> &sink, const optional<Tensor> &bias, at::TensorList aux,
               c10::ArrayRef<double> scalars)
        : q(conform_input(plan, q_in, plan.sizes[0], plan.strides[0], "q")),
          k(conform_input(plan, k_in, plan.sizes[1], plan.strides[1], "k")),
          v(conform_input(plan, v_in, plan.sizes[2], plan.strides[2], "v")),
          sinks(sink_buffer(plan, sink, q_in)),
          biases(bias_buffer(plan, bias, q_in)),
          operands(plan, aux, scalars) {}

    void *sink_pointer() const { return sinks.defined() ? sinks.data_ptr() : nullptr; }
    void *bias_pointer() const { return biases.defined() ? biases.data_ptr() : nullptr; }
};

// The slots of one pass: the graph's own, then the score_mod's operands.
template <size_t N>
std::vector<void *> with_operands(const std::array<void *, N> &own, const ScoreModOperands &operands) {
    std::vector<void *> slots(own.begin(), own.end());
    slots.insert(slots.end(), operands.pointers.begin(), operands.pointers.end());
    return slots;
}

// out and LSE (THD: (Tq, Hq, Dv) and (Tq, Hq)). The LSE is an empty tensor, not an undefined one,
// when the plan writes none: callers read its numel.
std::vector<Tensor> forward_outputs(const TorchPlan &plan, const Tensor &q) {
    std::vector<Tensor> outputs;
    outputs.reserve(4);
    if (plan.max_logit) {  // the LSE made from the row maxima and sums, then the largest logit per head
        outputs.push_back(new_tensor(plan.out_sizes, plan.out_strides, q.scalar_type(), q));
        outputs.push_back(new_dense(plan.lse_sizes, at::kFloat, q));
        outputs.push_back(new_dense({plan.heads_q}, at::kFloat, q));
        return outputs;
    }
    if (plan.ragged()) {
        outputs.push_back(new_dense({q.size(0), plan.heads_q, plan.out_sizes[3]}, q.scalar_type(), q));
        outputs.push_back(new_dense(plan.stats ? c10::IntArrayRef({q.size(0), plan.heads_q})
                                               : c10::IntArrayRef({0}), at::kFloat, q));
        return outputs;
    }
    outputs.push_back(new_tensor(plan.out_sizes, plan.out_strides, q.scalar_type(), q));
    outputs.push_back(new_dense(plan.stats ? c10::IntArrayRef(plan.lse_sizes) : c10::IntArrayRef({0}), at::kFloat,
                                q));
    return outputs;
}

// Rows a score_mod masked completely keep a finite LSE near the mask's score: output 0 and LSE -inf
// there, as on the Python path (backends/cudnn/torch_run.py: _clear_empty_rows). Returns the stats the
// backward reads: +inf there, so their probabilities are 0.
Tensor clear_empty_rows(const TorchPlan &plan, std::vector<Tensor> &outputs) {
    TORCH_CHECK(plan.stats, "fusedattn: a plan with empty_rows writes the LSE");
    Tensor raw = outputs[1];
    bool training = plan.backward >= 0;
    if (plan.empty_rows != nullptr && plan.sequences == nullptr && raw.dim() == 3) {  // one kernel, (B, H, S) rows
        Tensor rows = outputs[0].permute(plan.to_bhsd);
        Tensor lse = training ? at::empty_like(raw) : raw;
        int64_t count = raw.numel();
        std::vector<uint64_t> words = {word(rows), word(raw), word(lse), word(count), word(raw.size(1)),
                                       word(raw.size(2)), word(rows.stride(0)), word(rows.stride(1)),
                                       word(rows.stride(2))};
        int64_t per = plan.empty_rows_per_program;  // rows of one (i0, i1) a program takes (empty_rows_kernel.programs)
        int64_t programs = raw.size(0) * raw.size(1) * ((raw.size(2) + per - 1) / per);
        std::string error = plan.empty_rows->launch(raw.device().index(), current_stream(raw.device()), programs,
                                                    words);
        TORCH_CHECK(error.empty(), "fusedattn: ", error);
        if (!training) return Tensor();
        outputs[1] = lse;
        return raw;
    }
    Tensor empty = raw.ge(kMaskedBelow).logical_not_();  // NaN counts as empty too
    outputs[0].permute(plan.to_bhsd).masked_fill_(empty.unsqueeze(-1), 0);
    constexpr double inf = std::numeric_limits<double>::infinity();
    if (!training) {
        raw.masked_fill_(empty, -inf);
        return Tensor();
    }
    outputs[1] = raw.masked_fill(empty, -inf);
    return raw.masked_fill_(empty, inf);
}

// Rows a score_mod emptied inside a padded or THD call's sequences: output 0 and stats -inf, before
// fix_rows writes the LSE from the stats (torch_run.py: _clear_empty_rows, then fix_rows). raw: the
// graph's stats, (B, H, S) padded or (T, H) THD.
void clear_rows_in_sequences(const TorchPlan &plan, const Tensor &out, const Tensor &raw) {
    Tensor empty = raw.ge(kMaskedBelow).logical_not_().unsqueeze(-1);  // NaN counts as empty too
    (plan.ragged() ? out : out.permute(plan.to_bhsd)).masked_fill_(empty, 0);
    raw.masked_fill_(empty.squeeze(-1), -std::numeric_limits<double>::infinity());
}

// A padded or THD forward's sequence table: the kept one of tiling offsets where the eager operator may
// reuse it (KeptTables), else one written now. The table of a training call with tiling offsets is marked
// for its backward, which then skips the fix-ups (tiling_tables; add keeps a table where it first came, so
// a kept one past 1024 newer tables gets the fix-ups again, which cost time only).
Tensor call_table(const TorchPlan &plan, at::TensorList offsets, const Tensor &q, const Tensor &k, bool tiled) {
    const SequencePlan &sequences = *plan.sequences;
    auto written = [&] {
        return sequence_table(sequences, offsets, plan.ragged() ? q.size(0) : 0, plan.ragged() ? k.size(0) : 0, q);
    };
    if (!tiled) return written();
    Tensor table;
    void *stream = eager_forward ? current_stream(q.device()) : nullptr;
    if (eager_forward && !fusedattn_native::TritonKernel::capturing(stream)) {
        KeptTables::Key key{offsets[0].unsafeGetTensorImpl(), &sequences, q.size(0), q.device().index(), stream};
        table = kept_tables().find(key);
        if (!table.defined()) {
            table = written();
            kept_tables().add(key, offsets[0], plan.sequences, table);
        }
    } else {
        table = written();
    }
    if (plan.backward >= 0) tiling_tables().add(table);
    return table;
}

// The forward's outputs: out and LSE, then for a plan that trains the stats its backward reads where
// they are apart (separate_stats), then the sequence table where the plan has one.
std::vector<Tensor> forward_cuda(int64_t plan_id, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset, const optional<Tensor> &bias, at::TensorList aux,
                                 c10::ArrayRef<double> scalars, bool empty_rows, at::TensorList offsets) {
    Timer timer;
    auto plan = find_plan(plan_id);
    timer.mark(kFwdPlan);
    c10::DeviceGuard guard(q.device());
    timer.mark(kFwdGuard);
    const SequencePlan *sequences = plan->sequences.get();
    bool ragged = plan->ragged();
    PassInputs inputs(*plan, q, k, v, sink, bias, aux, scalars);
    timer.mark(kFwdInputs);
    Tensor table;
    bool tiled = false;  // no row to fix (tiles_every_token)
    if (sequences != nullptr) {
        tiled = tiles_every_token(*sequences, offsets, q.size(0), k.size(0));
        table = call_table(*plan, offsets, q, k, tiled);
    } else {
        TORCH_CHECK(offsets.empty(), "fusedattn: this plan takes no sequence offsets");
    }
    timer.mark(kFwdTable);
    auto outputs = forward_outputs(*plan, q);
    // A padded graph writes stats the backward reads; fix_rows writes the LSE returned from them.
    Tensor stats = sequences != nullptr && !ragged && plan->stats ? new_dense(plan->lse_sizes, at::kFloat, q)
                                                                  : outputs[1];
    timer.mark(kFwdOutputs);
    std::array<void *, kForwardSlots> own{};
    own[kFwdQ] = inputs.q.data_ptr();
    own[kFwdK] = inputs.k.data_ptr();
    own[kFwdV] = inputs.v.data_ptr();
    own[kFwdSink] = inputs.sink_pointer();
    own[kFwdSeed] = pointer(seed);
    own[kFwdOffset] = pointer(offset);
    own[kFwdO] = outputs[0].data_ptr();
    own[kFwdStats] = plan->stats ? stats.data_ptr() : nullptr;
    own[kFwdBias] = inputs.bias_pointer();
    Tensor row_max, sum_exp;
    if (plan->max_logit) {
        row_max = new_dense(plan->lse_sizes, at::kFloat, q);
        sum_exp = new_dense(plan->lse_sizes, at::kFloat, q);
        own[kFwdRowMax] = row_max.data_ptr();
        own[kFwdSumExp] = sum_exp.data_ptr();
    }
    if (sequences != nullptr) bind_table(sequences->forward_rows, *sequences, table, &own[kFwdSequences]);
    auto slots = with_operands(own, inputs.operands);
    launch(*plan, 0, q.device(), slots.data(), slots.size(), timer);
    if (plan->max_logit) {  // LSE = max + log(sum of exp(s - max)); the largest logit of each head
        at::add_out(outputs[1], row_max, sum_exp.log());
        at::amax_out(outputs[2], row_max, {0, 2});
    }
    Tensor backward_stats;
    bool score_mod_rows = sequences != nullptr && sequences->score_mod();
    if (empty_rows && !score_mod_rows) backward_stats = clear_empty_rows(*plan, outputs);
    if (sequences != nullptr) {
        Tensor lse, lse_stats;
        if (plan->stats) {  // (B, S, H) views; THD: the LSE is the stats, (T, H)
            lse = ragged ? outputs[1] : outputs[1].permute({0, 2, 1});
            lse_stats = ragged ? outputs[1] : stats.permute({0, 2, 1});
        }
        if (empty_rows && score_mod_rows) clear_rows_in_sequences(*plan, outputs[0], ragged ? outputs[1] : stats);
        // A score_mod's backward reads the LSE with +inf for -inf (as the Python path's): fix_rows writes it.
        Tensor bstats;
        if (score_mod_rows && plan->backward >= 0) {
            bstats = new_tensor(outputs[1].sizes(), outputs[1].strides(), at::kFloat, q);
            backward_stats = bstats;
        } else if (!ragged && plan->backward >= 0) {
            backward_stats = stats;
        }
        if (!tiled || bstats.defined()) {  // tiled, it would only write a score_mod backward's stats
            fix_rows(*sequences, kFixForward, table, ragged ? outputs[0] : bshd(*plan, outputs[0]), Tensor(), lse,
                     lse_stats, plan->sink_kind == kLearnableSink ? inputs.sinks : Tensor(), sequences->seqlen_q,
                     bstats.defined() ? (ragged ? bstats : bstats.permute({0, 2, 1})) : Tensor());
        }
    }
    if (plan->separate_stats(empty_rows)) outputs.push_back(backward_stats);
    if (sequences != nullptr && plan->backward >= 0) outputs.push_back(table);
    timer.mark(kFwdAfter);
    return outputs;
}

void check_shapes(const TorchPlan &plan, const Tensor &q, const Tensor &k, const Tensor &v) {
    const char *names[3] = {"q", "k", "v"};
    const Tensor *tensors[3] = {&q, &k, &v};
    for (int role = 0; role < 3; ++role) {
        if (plan.ragged()) {
            check_tokens(*tensors[role], plan.sizes[role], names[role]);
            continue;
        }
        TORCH_CHECK(tensors[role]->sizes().equals(plan.sizes[role]), "fusedattn: ", names[role], ": expected shape ",
                    c10::IntArrayRef(plan.sizes[role]), " (the registered plan's), got ", tensors[role]->sizes());
    }
}

std::vector<Tensor> forward_meta(int64_t plan_id, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset, const optional<Tensor> &bias, at::TensorList aux,
                                 c10::ArrayRef<double> scalars, bool empty_rows, at::TensorList offsets) {
    auto plan = find_plan(plan_id);
    check_shapes(*plan, q, k, v);
    bias_buffer(*plan, bias, q);
    ScoreModOperands::check(*plan, aux, scalars);
    auto outputs = forward_outputs(*plan, q);
    if (plan->separate_stats(empty_rows)) {  // the LSE's shape: (B, H, S), THD (T, H)
        outputs.push_back(new_dense(plan->ragged() ? outputs[1].sizes() : c10::IntArrayRef(plan->lse_sizes),
                                    at::kFloat, q));
    }
    if (plan->sequences != nullptr) {
        const SequencePlan &sequences = *plan->sequences;
        Tensor table = sequence_table(sequences, offsets, plan->ragged() ? q.size(0) : 0,
                                      plan->ragged() ? k.size(0) : 0, q, false);
        if (plan->backward >= 0) outputs.push_back(table);
    } else {
        TORCH_CHECK(offsets.empty(), "fusedattn: this plan takes no sequence offsets");
    }
    return outputs;
}

// dq, dk, dv, then dSink where the plan has sinks (the graph writes it for both kinds), then dBias
// where the plan's backward writes it (reduced to the bias's own shape and dtype). THD gradients are
// dense tokens, (T, H, D) like their inputs.
std::vector<Tensor> backward_outputs(const TorchPlan &plan, const Tensor &q, const Tensor &k, const Tensor &v) {
    std::vector<Tensor> grads;
    grads.reserve(5);
    const Tensor *inputs[3] = {&q, &k, &v};
    for (int role = 0; role < 3; ++role) {
        if (plan.ragged()) {
            grads.push_back(new_dense(inputs[role]->sizes(), q.scalar_type(), q));
        } else {
            grads.push_back(new_tensor(plan.sizes[role], plan.grad_strides[role], q.scalar_type(), q));
        }
    }
    if (plan.sink_kind != kNoSink) grads.push_back(new_dense({1, plan.heads_q, 1, 1}, at::kFloat, q));
    if (plan.bias_grad) grads.push_back(new_dense(plan.bias_dims, q.scalar_type(), q));
    return grads;
}

// dBias over the graph's dims summed over the axes the bias broadcast along, in the bias's shape and dtype.
Tensor bias_gradient(const TorchPlan &plan, const Tensor &dbias, const Tensor &bias) {
    std::vector<int64_t> axes;
    for (int64_t axis = 0; axis < 4; ++axis) {
        if (plan.bias_shape[axis] == 1 && plan.bias_dims[axis] > 1) axes.push_back(axis);
    }
    Tensor grad = axes.empty() ? dbias : dbias.sum(axes, true);
    if (plan.bias_kind == kPreScaleBias) grad = grad.mul(plan.scale);
    return grad.to(bias.scalar_type()).reshape(bias.sizes());
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

void check_table(const TorchPlan &plan, const optional<Tensor> &table) {
    TORCH_CHECK((plan.sequences != nullptr) == (table.has_value() && table->defined()),
                "fusedattn: a padded or THD plan's backward takes its forward's sequence table (and no other does)");
}

// stats: what the backward reads as the LSE (the forward's third output where it has one); table: the
// forward's sequence table, for a padded or THD plan.
std::vector<Tensor> backward_cuda(int64_t plan_id, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &stats, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset, const optional<Tensor> &bias, at::TensorList aux,
                                  c10::ArrayRef<double> scalars, const optional<Tensor> &table) {
    Timer timer;
    auto plan = find_plan(plan_id);
    TORCH_CHECK(plan->backward >= 0, "fusedattn: native plan ", plan_id, " was registered for inference");
    timer.mark(kBwdPlan);
    refuse_lse_gradient(grad_lse);
    timer.mark(kBwdRefuse);
    c10::DeviceGuard guard(q.device());
    timer.mark(kBwdGuard);
    const SequencePlan *sequences = plan->sequences.get();
    check_table(*plan, table);
    bool ragged = plan->ragged();
    PassInputs inputs(*plan, q, k, v, sink, bias, aux, scalars);
    Tensor dout = conform_input(*plan, grad_out, plan->out_sizes, plan->out_strides, "grad_out");
    timer.mark(kBwdInputs);
    auto grads = backward_outputs(*plan, q, k, v);
    timer.mark(kBwdOutputs);
    size_t dsink = 3, dbias = plan->sink_kind != kNoSink ? 4 : 3;
    std::array<void *, kBackwardSlots> own{};
    own[kBwdQ] = inputs.q.data_ptr();
    own[kBwdK] = inputs.k.data_ptr();
    own[kBwdV] = inputs.v.data_ptr();
    own[kBwdO] = out.data_ptr();
    own[kBwdDO] = dout.data_ptr();
    own[kBwdStats] = stats.data_ptr();
    own[kBwdSink] = inputs.sink_pointer();
    own[kBwdSeed] = pointer(seed);
    own[kBwdOffset] = pointer(offset);
    own[kBwdDQ] = grads[0].data_ptr();
    own[kBwdDK] = grads[1].data_ptr();
    own[kBwdDV] = grads[2].data_ptr();
    own[kBwdDSink] = plan->sink_kind != kNoSink ? grads[dsink].data_ptr() : nullptr;
    own[kBwdBias] = inputs.bias_pointer();
    own[kBwdDBias] = plan->bias_grad ? grads[dbias].data_ptr() : nullptr;
    if (sequences != nullptr) bind_table(sequences->backward_rows, *sequences, *table, &own[kBwdSequences]);
    auto slots = with_operands(own, inputs.operands);
    launch(*plan, 1, q.device(), slots.data(), slots.size(), timer);
    if (sequences != nullptr && !tiling_tables().contains(*table)) {
        // the rows cuDNN leaves: outside every sequence, or with an empty other side
        auto view = [&](const Tensor &grad) { return ragged ? grad : bshd(*plan, grad); };
        fix_rows(*sequences, kFixBackwardQ, *table, view(grads[0]), Tensor(), Tensor(), Tensor(), Tensor(),
                 sequences->seqlen_q);
        fix_rows(*sequences, kFixBackwardKV, *table, view(grads[1]), view(grads[2]), Tensor(), Tensor(), Tensor(),
                 sequences->seqlen_kv);
        if (plan->sink_kind != kNoSink) grads[dsink] = poisoned(*sequences, *table, grads[dsink]);
    }
    if (plan->bias_grad) {
        grads[dbias] = bias_gradient(*plan, grads[dbias], *bias);
        if (sequences != nullptr) grads[dbias] = poisoned(*sequences, *table, grads[dbias]);
    }
    timer.mark(kBwdAfter);
    return grads;
}

std::vector<Tensor> backward_meta(int64_t plan_id, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &stats, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset, const optional<Tensor> &bias, at::TensorList aux,
                                  c10::ArrayRef<double> scalars, const optional<Tensor> &table) {
    auto plan = find_plan(plan_id);
    check_shapes(*plan, q, k, v);
    bias_buffer(*plan, bias, q);
    ScoreModOperands::check(*plan, aux, scalars);
    check_table(*plan, table);
    auto grads = backward_outputs(*plan, q, k, v);
    if (plan->bias_grad) {
        TORCH_CHECK(bias.has_value() && bias->defined(), "fusedattn: this plan needs the bias");
        grads.back() = new_dense(bias->sizes(), bias->scalar_type(), q);
    }
    return grads;
}

std::vector<Tensor> call_forward(int64_t plan, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const optional<Tensor> &sink, const optional<Tensor> &seed,
                                 const optional<Tensor> &offset, const optional<Tensor> &bias, at::TensorList aux,
                                 c10::ArrayRef<double> scalars, bool empty_rows, at::TensorList offsets) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::forward", "")
                         .typed<decltype(forward_cuda)>();
    return op.call(plan, q, k, v, sink, seed, offset, bias, aux, scalars, empty_rows, offsets);
}

std::vector<Tensor> call_backward(int64_t plan, const Tensor &grad_out, const optional<Tensor> &grad_lse,
                                  const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out,
                                  const Tensor &stats, const optional<Tensor> &sink, const optional<Tensor> &seed,
                                  const optional<Tensor> &offset, const optional<Tensor> &bias, at::TensorList aux,
                                  c10::ArrayRef<double> scalars, const optional<Tensor> &table) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::backward", "")
                         .typed<decltype(backward_cuda)>();
    return op.call(plan, grad_out, grad_lse, q, k, v, out, stats, sink, seed, offset, bias, aux, scalars, table);
}

Tensor defined_or_empty(const optional<Tensor> &x) { return x.has_value() ? *x : Tensor(); }

optional<Tensor> as_optional(const Tensor &x) { return x.defined() ? optional<Tensor>(x) : c10::nullopt; }

// A THD plan also takes dense (B, S, H, D) q, k, v whose B*S rows are its tokens (a document mask's
// call, torch/functional.py): out and the LSE then come back dense, (B, S, H, Dv) and (B, H, S), and the
// gradients in the inputs' shapes, with no view of theirs in autograd's graph. These give each side's form.
bool dense_tokens(const TorchPlan &plan, const Tensor &q) { return plan.ragged() && q.dim() == 4; }

Tensor as_tokens(const Tensor &x) {  // one view where the rows are evenly strided, else reshape's copy
    if (x.size(0) == 1 || x.stride(0) == x.size(1) * x.stride(1)) {
        return restrided(x, {x.size(0) * x.size(1), x.size(2), x.size(3)}, {x.stride(1), x.stride(2), x.stride(3)});
    }
    return x.reshape({-1, x.size(2), x.size(3)});
}

// A (B, H, S) LSE as the THD LSE (T, H); an empty one (a plan without stats) as it is.
Tensor lse_as_tokens(const Tensor &lse) {
    if (lse.dim() != 3) return lse;
    if (lse.size(0) == 1 || lse.stride(0) == lse.size(2) * lse.stride(2)) {  // as outputs_as_dense made it
        return restrided(lse, {lse.size(0) * lse.size(2), lse.size(1)}, {lse.stride(2), lse.stride(1)});
    }
    return lse.permute({0, 2, 1}).reshape({-1, lse.size(1)});
}

// The forward's THD out and LSE (fresh, dense) back in the dense form of q (B, S, ...): views of the same memory.
void outputs_as_dense(std::vector<Tensor> &outputs, const Tensor &q) {
    int64_t batch = q.size(0), seqlen = q.size(1);
    outputs[0] = dense_as(outputs[0], {batch, seqlen, outputs[0].size(1), outputs[0].size(2)});
    if (outputs[1].dim() == 2) {  // (T, H) as (B, H, S)
        int64_t heads = outputs[1].size(1);
        Tensor &lse = outputs[1];
        lse = lse.is_contiguous() ? restrided(lse, {batch, heads, seqlen}, {seqlen * heads, 1, heads})
                                  : lse.view({batch, seqlen, heads}).permute({0, 2, 1});
    }
}

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The autograd node of one attention call, made as torch's generated code makes those of its own ops
// (lighter than a custom autograd Function): it saves what the backward op reads and calls it.
struct AttentionBackward : public torch::autograd::Node {
    int64_t plan = -1;
    SavedVariable q, k, v, out, stats, sink, seed, offset, bias, table;
    std::vector<SavedVariable> aux;
    std::vector<double> scalars;
    bool dense = false;  // a THD plan's dense inputs (dense_tokens): the saved tensors are dense too
    std::vector<int64_t> input_sizes[3];  // q, k, v's (dense only): their gradients' shapes

    std::string name() const override { return "FusedAttentionBackward"; }

    void release_variables() override {
        for (auto *saved : {&q, &k, &v, &out, &stats, &sink, &seed, &offset, &bias, &table}) saved->reset_data();
        for (auto &saved : aux) saved.reset_data();
    }

    // grads: of out and lse (either undefined when unused); returns those of q, k, v, sink and bias.
    variable_list apply(variable_list &&grads) override {
        Timer timer;
        auto self = getptr();
        Tensor outs = out.unpack(self);
        Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(outs);
        Tensor sinks = sink.unpack(self);
        Tensor biases = bias.unpack(self);
        std::vector<Tensor> aux_tensors;
        aux_tensors.reserve(aux.size());
        for (auto &saved : aux) aux_tensors.push_back(saved.unpack(self));
        timer.mark(kSaved);
        Tensor inputs[3] = {q.unpack(self), k.unpack(self), v.unpack(self)};
        Tensor stat = stats.unpack(self);
        if (dense) {  // as the forward makes them: views the backward op reads, not autograd's
            at::AutoDispatchBelowADInplaceOrView below;
            for (auto &x : inputs) x = as_tokens(x);
            outs = as_tokens(outs);
            grad_out = as_tokens(grad_out);
            stat = lse_as_tokens(stat);
        }
        auto result = call_backward(plan, grad_out, as_optional(grads[1]), inputs[0], inputs[1], inputs[2], outs,
                                    stat, as_optional(sinks), as_optional(seed.unpack(self)),
                                    as_optional(offset.unpack(self)), as_optional(biases), aux_tensors, scalars,
                                    as_optional(table.unpack(self)));
        timer.mark(kBackwardCall);
        variable_list gradients(5);
        for (int role = 0; role < 3; ++role) {  // (dense: views of the THD gradients, their bases dropped)
            gradients[role] = dense ? dense_as(result[role], input_sizes[role]) : std::move(result[role]);
        }
        size_t next = 3;
        if (sinks.defined() && result.size() > next) {  // learnable sinks: an off-by-one sink is no input
            gradients[3] = result[next].reshape({-1}).to(sinks.scalar_type());
        }
        if (find_plan(plan)->sink_kind != kNoSink) ++next;
        if (biases.defined() && result.size() > next) gradients[4] = std::move(result[next]);
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
                                       const optional<Tensor> &offset, const optional<Tensor> &bias,
                                       at::TensorList aux, c10::ArrayRef<double> scalars, bool empty_rows,
                                       at::TensorList offsets) {
    Timer whole;
    auto owner = find_plan(plan);
    bool grad_mode = at::GradMode::is_enabled();
    bool differentiable = grad_mode && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                        requires_grad(sink) || requires_grad(bias));
    for (const Tensor &x : aux) {
        TORCH_CHECK(!(grad_mode && x.requires_grad()), "fusedattn: score_mod aux tensors that require grad have no "
                    "gradient on the native operator; fusedattn.torch.attention runs such calls on its Python path");
    }
    std::vector<Tensor> outputs;
    bool dense = dense_tokens(*owner, q);
    {
        at::AutoDispatchBelowADInplaceOrView below;  // (views made here are not autograd's)
        EagerForward eager;  // (its table is kept internally, never an output of this op)
        Timer timer;
        if (dense) {
            TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == q.size(0) && v.size(0) == q.size(0),
                        "fusedattn: a THD plan given dense q (B, S, H, D) takes k and v of q's batch, (B, S, H, D); "
                        "got k ", k.sizes(), ", v ", v.sizes());
            outputs = call_forward(plan, as_tokens(q), as_tokens(k), as_tokens(v), sink, seed, offset, bias, aux,
                                   scalars, empty_rows, offsets);
            outputs_as_dense(outputs, q);
        } else {
            outputs = call_forward(plan, q, k, v, sink, seed, offset, bias, aux, scalars, empty_rows, offsets);
        }
        timer.mark(kForwardCall);
    }
    if (differentiable) {
        Timer timer;
        auto node = NodeMaker<NodePointer, AttentionBackward>::make();
        Tensor sinks = defined_or_empty(sink);
        Tensor biases = defined_or_empty(bias);
        node->set_next_edges(torch::autograd::collect_next_edges(q, k, v, sinks, biases));
        node->plan = plan;
        node->dense = dense;
        if (dense) {
            node->input_sizes[0] = q.sizes().vec();
            node->input_sizes[1] = k.sizes().vec();
            node->input_sizes[2] = v.sizes().vec();
        }
        NodePointer base = node;
        torch::autograd::set_history(outputs[0], base);
        torch::autograd::set_history(outputs[1], base);
        node->q = SavedVariable(q, false);
        node->k = SavedVariable(k, false);
        node->v = SavedVariable(v, false);
        node->sink = SavedVariable(sinks, false);
        node->seed = SavedVariable(defined_or_empty(seed), false);
        node->offset = SavedVariable(defined_or_empty(offset), false);
        node->bias = SavedVariable(biases, false);
        node->out = SavedVariable(outputs[0], true);
        // The stats the backward reads: the LSE, or the forward's own (separate_stats), and the sequence
        // table; neither is an output of this op, so they are saved as inputs would be.
        size_t next = owner->max_logit ? 3 : 2;
        node->stats = owner->separate_stats(empty_rows) ? SavedVariable(outputs[next++], false)
                                                                  : SavedVariable(outputs[1], true);
        node->table = SavedVariable(outputs.size() > next ? outputs[next] : Tensor(), false);
        node->aux.reserve(aux.size());
        for (const Tensor &x : aux) node->aux.emplace_back(x, false);
        node->scalars.assign(scalars.begin(), scalars.end());
        timer.mark(kSave);
    }
    outputs.resize(owner->max_logit ? 3 : 2);  // out, LSE and max_logit where the plan has it
    whole.mark(kWhole);
    return outputs;
}

}  // namespace

// The operands after the graph's own (see the top of this file). No defaults: a schema cannot give a
// tensor list one, so plain calls pass None, [], [] (and False, [] for empty_rows and the offsets).
#define FUSEDATTN_OPERANDS "Tensor? bias, Tensor[] aux, float[] scalars"

TORCH_LIBRARY(fusedattn_native, m) {
    m.def("attention(int plan, Tensor q, Tensor k, Tensor v, Tensor? sink, Tensor? seed, Tensor? offset, "
          FUSEDATTN_OPERANDS ", bool empty_rows, Tensor[] offsets) -> Tensor[]");
    m.def("forward(int plan, Tensor q, Tensor k, Tensor v, Tensor? sink, Tensor? seed, Tensor? offset, "
          FUSEDATTN_OPERANDS ", bool empty_rows, Tensor[] offsets) -> Tensor[]");
    m.def("backward(int plan, Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
          "Tensor stats, Tensor? sink, Tensor? seed, Tensor? offset, " FUSEDATTN_OPERANDS
          ", Tensor? table) -> Tensor[]");
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
// library is built with Python's headers. It reads its arguments straight from CPython (no binding
// layer, no schema conversion as torch.ops' boxed call does); autograd, capture and every dispatch key
// still apply, as the call goes through the dispatcher.
#include <torch/csrc/autograd/python_variable.h>

#include "warm_entries.h"

namespace {

// The operator's arguments after the plan, as Python passes them: positionally, the trailing ones optional.
constexpr const char *kEntryArguments[] = {"plan", "q", "k", "v", "sink", "seed", "offset", "bias", "aux",
                                           "scalars", "empty_rows", "offsets"};
constexpr Py_ssize_t kEntryRequired = 7, kEntryMost = 12;

struct BadArgument {
    std::string message;
};

BadArgument bad(Py_ssize_t index, const char *expected, PyObject *given) {
    return {std::string("fusedattn_native.attention: ") + kEntryArguments[index] + ": expected " + expected +
            ", got " + Py_TYPE(given)->tp_name};
}

const Tensor &tensor_argument(PyObject *const *args, Py_ssize_t index) {
    if (!THPVariable_Check(args[index])) throw bad(index, "a torch.Tensor", args[index]);
    return THPVariable_Unpack(args[index]);
}

optional<Tensor> optional_argument(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t index) {
    if (index >= nargs || args[index] == Py_None) return c10::nullopt;
    return tensor_argument(args, index);
}

// A list or tuple of `read(item)`, empty where the argument is left out.
template <class T, class Read>
std::vector<T> list_argument(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t index, const char *expected,
                             Read read) {
    std::vector<T> values;
    if (index >= nargs) return values;
    PyObject *given = args[index];
    if (!PyList_Check(given) && !PyTuple_Check(given)) throw bad(index, expected, given);
    Py_ssize_t size = PySequence_Fast_GET_SIZE(given);
    PyObject **items = PySequence_Fast_ITEMS(given);
    values.reserve(size);
    for (Py_ssize_t i = 0; i < size; ++i) {
        if (!read(items[i], values)) throw bad(index, expected, items[i]);
    }
    return values;
}

// torch's errors as torch.ops raises them: its Python types, without the C++ backtrace.
void raise_error(const std::exception_ptr &error) {
    auto raise = [](PyObject *type, const c10::Error &e) { PyErr_SetString(type, e.what_without_backtrace()); };
    try {
        std::rethrow_exception(error);
    } catch (const BadArgument &e) {
        PyErr_SetString(PyExc_TypeError, e.message.c_str());
    } catch (const c10::OutOfMemoryError &e) {
        PyObject *torch = PyImport_ImportModule("torch");
        PyObject *type = torch == nullptr ? nullptr : PyObject_GetAttrString(torch, "OutOfMemoryError");
        Py_XDECREF(torch);
        if (type != nullptr) raise(type, e);
        Py_XDECREF(type);
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
    } catch (const std::exception &e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
}

// The GIL released for a scope (the operator's launch), taken back however the scope ends.
struct WithoutGil {
    PyThreadState *state = PyEval_SaveThread();
    WithoutGil() = default;
    WithoutGil(const WithoutGil &) = delete;
    WithoutGil &operator=(const WithoutGil &) = delete;
    ~WithoutGil() { PyEval_RestoreThread(state); }
};

PyObject *python_attention(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::attention", "")
                         .typed<decltype(attention_autograd)>();
    try {
        if (nargs < kEntryRequired || nargs > kEntryMost) {
            throw BadArgument{"fusedattn_native.attention: expected " + std::to_string(kEntryRequired) + " to " +
                              std::to_string(kEntryMost) + " positional arguments, got " + std::to_string(nargs)};
        }
        if (!PyLong_Check(args[0])) throw bad(0, "an int", args[0]);
        int64_t plan = PyLong_AsLongLong(args[0]);
        if (plan == -1 && PyErr_Occurred()) return nullptr;
        const Tensor &q = tensor_argument(args, 1), &k = tensor_argument(args, 2), &v = tensor_argument(args, 3);
        auto read_tensor = [](PyObject *item, std::vector<Tensor> &out) {
            if (!THPVariable_Check(item)) return false;
            out.push_back(THPVariable_Unpack(item));
            return true;
        };
        auto read_number = [](PyObject *item, std::vector<double> &out) {
            if (!PyFloat_Check(item) && !PyLong_Check(item)) return false;
            out.push_back(PyFloat_AsDouble(item));
            return true;
        };
        optional<Tensor> sink = optional_argument(args, nargs, 4), seed = optional_argument(args, nargs, 5),
                         offset = optional_argument(args, nargs, 6), bias = optional_argument(args, nargs, 7);
        auto aux = list_argument<Tensor>(args, nargs, 8, "a list of torch.Tensor", read_tensor);
        auto scalars = list_argument<double>(args, nargs, 9, "a list of numbers", read_number);
        bool empty_rows = false;
        if (nargs > 10) {
            if (!PyBool_Check(args[10])) throw bad(10, "a bool", args[10]);
            empty_rows = args[10] == Py_True;
        }
        auto offsets = list_argument<Tensor>(args, nargs, 11, "a list of torch.Tensor", read_tensor);
        std::vector<Tensor> outputs;
        {
            WithoutGil released;
            outputs = op.call(plan, q, k, v, sink, seed, offset, bias, aux, scalars, empty_rows, offsets);
        }
        PyObject *result = PyTuple_New(static_cast<Py_ssize_t>(outputs.size()));
        if (result == nullptr) return nullptr;
        for (size_t i = 0; i < outputs.size(); ++i) {
            PyObject *item = THPVariable_Wrap(std::move(outputs[i]));
            if (item == nullptr) {
                Py_DECREF(result);
                return nullptr;
            }
            PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), item);
        }
        return result;
    } catch (...) {
        raise_error(std::current_exception());
        return nullptr;
    }
}

// warm_call(q, k, v, keywords): the output of a repeat call its warm entry answers (warm_entries.h), or
// (out, lse or None, max_logit or None) where the call returns those; None: a miss (the Python path runs it).
PyObject *python_warm_call(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fusedattn_native::attention", "")
                         .typed<decltype(attention_autograd)>();
    auto &kept = fusedattn_warm::entries();
    if (nargs != 4 || kept.by_key.empty()) Py_RETURN_NONE;
    std::shared_ptr<fusedattn_warm::Entry> entry;
    optional<Tensor> bias, sink;
    try {
        fusedattn_warm::KeyWriter writer(kept.identity_types, kept.parts_attribute);
        if (!writer.call(args[0], args[1], args[2], args[3], kept.settings)) Py_RETURN_NONE;
        auto found = kept.by_key.find(writer.key);
        if (found == kept.by_key.end() || !found->second->holds()) Py_RETURN_NONE;
        entry = found->second;
        if (writer.bias != nullptr) bias = THPVariable_Unpack(writer.bias);
        if (writer.sink != nullptr) sink = THPVariable_Unpack(writer.sink);
    } catch (...) {  // nothing can be read as a key: the Python path explains
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const Tensor &q = THPVariable_Unpack(args[0]), &k = THPVariable_Unpack(args[1]), &v = THPVariable_Unpack(args[2]);
    try {
        std::vector<Tensor> outputs;
        {
            WithoutGil released;
            optional<Tensor> seed, offset;
            if (entry->dropout) {  // functional._dropout_state's draw: torch.randint(0, 2**31 - 1, ()), offset 0
                int64_t drawn = at::randint(0, 2147483647, {}, at::TensorOptions().dtype(at::kLong)).item<int64_t>();
                seed = at::full({}, drawn, q.options().dtype(at::kLong));
                offset = at::full({}, 0, q.options().dtype(at::kLong));
            }
            outputs = op.call(entry->plan, q, k, v, sink, seed, offset, bias, entry->aux, entry->scalars,
                              entry->empty_rows, entry->offsets);
        }
        if (!entry->lse && !entry->max_logit) return THPVariable_Wrap(std::move(outputs[0]));
        PyObject *result = PyTuple_New(3);  // (out, lse or None, max_logit or None): AttentionResult's fields
        if (result == nullptr) return nullptr;
        for (size_t i = 0; i < 3; ++i) {
            bool wanted = i == 0 || (i == 1 && entry->lse) || (i == 2 && entry->max_logit && outputs.size() > 2);
            PyObject *item = wanted ? THPVariable_Wrap(std::move(outputs[i])) : Py_NewRef(Py_None);
            if (item == nullptr) {
                Py_DECREF(result);
                return nullptr;
            }
            PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), item);
        }
        return result;
    } catch (const c10::Error &error) {
        if (std::strstr(error.what_without_backtrace(), kNotRegistered) != nullptr) {  // the registry dropped it
            kept.by_key.clear();
            Py_RETURN_NONE;
        }
        raise_error(std::current_exception());
        return nullptr;
    } catch (...) {
        raise_error(std::current_exception());
        return nullptr;
    }
}

// Reads a tuple or list of Python objects into held references.
std::vector<fusedattn_warm::Held> held_items(PyObject *items) {
    if (!PyTuple_Check(items) && !PyList_Check(items)) throw BadArgument{"fusedattn warm entry: expected a tuple"};
    std::vector<fusedattn_warm::Held> held;
    PyObject **each = PySequence_Fast_ITEMS(items);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); ++i) held.emplace_back(each[i]);
    return held;
}

// warm_configure(settings, identity_types, capacity, parts_attribute): the environment settings a key reads (a
// tuple of str), the keyword types it names by identity (a tuple of types), how many entries are kept, and the
// instance attribute through which an object of those types may name what it is made of instead (a tuple the
// key reads by value); drops every entry.
PyObject *python_warm_configure(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyLong_Check(args[2]) ||
        !PyUnicode_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "warm_configure(settings, identity_types, capacity, parts_attribute): "
                                         "expected two tuples, an int and a str");
        return nullptr;
    }
    size_t capacity = PyLong_AsSize_t(args[2]);
    if (PyErr_Occurred()) return nullptr;
    auto &kept = fusedattn_warm::entries();
    kept.by_key.clear();
    kept.capacity = capacity;
    for (PyObject **field : {&kept.settings, &kept.identity_types, &kept.parts_attribute}) Py_XDECREF(*field);
    kept.settings = args[0];
    kept.identity_types = args[1];
    kept.parts_attribute = args[3];
    for (PyObject *field : {kept.settings, kept.identity_types, kept.parts_attribute}) Py_INCREF(field);
    Py_RETURN_NONE;
}

// warm_remember(q, k, v, keywords, plan, aux, scalars, empty_rows, functions, dicts, tensors, offsets, returns):
// keeps the answer the Python path gave this call (the operator's plan and operands) under the call's key, with
// its guards: functions ((fn, cells' contents, names, their globals), ...), dicts ((dict, keys, values), ...) and
// tensors ((tensor, version, requires_grad), ...). returns: (lse, max_logit, dropout): whether each of the first
// two is returned beside the output, and whether each call draws a dropout seed. Whether kept (a call with no key
// is not).
PyObject *python_warm_remember(PyObject *, PyObject *const *args, Py_ssize_t nargs) try {
    if (nargs != 13) throw BadArgument{"fusedattn warm_remember: expected 13 arguments"};
    auto &kept = fusedattn_warm::entries();
    if (kept.settings == nullptr) throw BadArgument{"fusedattn warm_remember: warm_configure first"};
    fusedattn_warm::KeyWriter writer(kept.identity_types, kept.parts_attribute);
    if (!writer.call(args[0], args[1], args[2], args[3], kept.settings)) Py_RETURN_FALSE;
    auto entry = std::make_shared<fusedattn_warm::Entry>();
    entry->plan = PyLong_AsLongLong(args[4]);
    if (entry->plan == -1 && PyErr_Occurred()) return nullptr;
    for (auto &item : held_items(args[5])) {
        if (!THPVariable_Check(item.get())) throw BadArgument{"warm_remember: aux: expected tensors"};
        entry->aux.push_back(THPVariable_Unpack(item.get()));
    }
    for (auto &item : held_items(args[6])) entry->scalars.push_back(PyFloat_AsDouble(item.get()));
    for (auto &item : held_items(args[11])) {
        if (!THPVariable_Check(item.get())) throw BadArgument{"warm_remember: offsets: expected tensors"};
        entry->offsets.push_back(THPVariable_Unpack(item.get()));
    }
    if (PyErr_Occurred()) return nullptr;
    entry->empty_rows = args[7] == Py_True;
    auto returns = held_items(args[12]);
    if (returns.size() != 3) throw BadArgument{"warm_remember: returns: expected (lse, max_logit, dropout)"};
    entry->lse = returns[0].get() == Py_True;
    entry->max_logit = returns[1].get() == Py_True;
    entry->dropout = returns[2].get() == Py_True;
    for (PyObject *object : writer.identities) entry->identities.emplace_back(object);
    for (auto &item : held_items(args[8])) {
        auto parts = held_items(item.get());
        if (parts.size() != 4 || !PyFunction_Check(parts[0].get())) throw BadArgument{"warm_remember: bad function guard"};
        fusedattn_warm::FunctionGuard guard{parts[0], fusedattn_warm::Held(PyFunction_GET_CODE(parts[0].get())),
                                            held_items(parts[1].get()), held_items(parts[2].get()),
                                            held_items(parts[3].get())};
        if (guard.names.size() != guard.globals.size()) throw BadArgument{"warm_remember: bad function guard"};
        entry->functions.push_back(std::move(guard));
    }
    for (auto &item : held_items(args[9])) {
        auto parts = held_items(item.get());
        if (parts.size() != 3 || !PyDict_CheckExact(parts[0].get())) throw BadArgument{"warm_remember: bad dict guard"};
        entry->dicts.push_back({parts[0], held_items(parts[1].get()), held_items(parts[2].get())});
    }
    for (auto &item : held_items(args[10])) {
        auto parts = held_items(item.get());
        if (parts.size() != 3 || !THPVariable_Check(parts[0].get())) throw BadArgument{"warm_remember: bad tensor guard"};
        entry->tensors.push_back({THPVariable_Unpack(parts[0].get()), PyLong_AsLongLong(parts[1].get()),
                                  parts[2].get() == Py_True});
    }
    if (PyErr_Occurred()) return nullptr;
    if (kept.by_key.size() >= kept.capacity) kept.by_key.clear();
    kept.by_key[writer.key] = std::move(entry);
    Py_RETURN_TRUE;
} catch (...) {
    raise_error(std::current_exception());
    return nullptr;
}

// warm_clear(): drops every warm entry (Python's caches behind them were cleared); warm_size(): how many are kept.
PyObject *python_warm_clear(PyObject *, PyObject *) {
    fusedattn_warm::entries().by_key.clear();
    Py_RETURN_NONE;
}

// tiling_offsets(cu_seqlens): this library made them, every sequence non-empty, together covering every
// token (tiles_every_token); the caller never changes them.
PyObject *python_tiling_offsets(PyObject *, PyObject *offsets) {
    if (!THPVariable_Check(offsets)) {
        PyErr_SetString(PyExc_TypeError, "tiling_offsets: expected a tensor");
        return nullptr;
    }
    tiling_offsets().add(THPVariable_Unpack(offsets));
    Py_RETURN_NONE;
}

PyObject *python_warm_size(PyObject *, PyObject *) {
    return PyLong_FromSize_t(fusedattn_warm::entries().by_key.size());
}

// tensor_key(*tensors): bytes that name each tensor's shape, strides, dtype, device and requires_grad
// (a missing one: None), equal exactly when those agree; None where an argument is no dense strided
// tensor with concrete sizes (nested, sparse or symbolic ones: the full path explains them).
// The plan-cache signature of a repeat call (fusedattn/torch/functional.py) reads it in one call.
PyObject *python_tensor_key(PyObject *, PyObject *const *args, Py_ssize_t nargs) try {
    std::string words;
    words.reserve(static_cast<size_t>(nargs) * 16 * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < nargs; ++i) {
        if (args[i] == Py_None) {
            int64_t missing = -1;
            words.append(reinterpret_cast<const char *>(&missing), sizeof missing);
            continue;
        }
        if (!THPVariable_Check(args[i]) || !fusedattn_warm::append_tensor_words(THPVariable_Unpack(args[i]), words)) {
            Py_RETURN_NONE;
        }
    }
    return PyBytes_FromStringAndSize(words.data(), static_cast<Py_ssize_t>(words.size()));
} catch (...) {  // a tensor that cannot say its sizes or strides: no key, as for any other odd argument
    Py_RETURN_NONE;
}

PyMethodDef entry_methods[] = {
    {"tensor_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&python_tensor_key)), METH_FASTCALL,
     "tensor_key(*tensors) -> bytes naming their shapes, strides, dtypes, devices and requires_grad"},
    {"attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&python_attention)), METH_FASTCALL,
     "fusedattn_native.attention(plan, q, k, v, sink, seed, offset[, bias, aux, scalars, empty_rows, offsets])"},
    {"warm_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&python_warm_call)), METH_FASTCALL,
     "warm_call(q, k, v, keywords) -> the output of a call its warm entry answers, or None"},
    {"warm_remember", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&python_warm_remember)),
     METH_FASTCALL, "warm_remember(q, k, v, keywords, plan, aux, scalars, empty_rows, functions, dicts, tensors, "
     "offsets, returns) -> whether the call's answer is kept"},
    {"warm_configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&python_warm_configure)),
     METH_FASTCALL, "warm_configure(settings, identity_types, capacity): what a key reads from the environment "
     "and by identity; how many entries are kept"},
    {"warm_clear", &python_warm_clear, METH_NOARGS, "warm_clear(): drop every warm entry"},
    {"warm_size", &python_warm_size, METH_NOARGS, "warm_size() -> the number of warm entries"},
    {"tiling_offsets", &python_tiling_offsets, METH_O,
     "tiling_offsets(cu_seqlens): offsets made here whose sequences are non-empty and cover every token"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef entry_module = {PyModuleDef_HEAD_INIT, "libfusedattn_torch", nullptr, -1, entry_methods};

}  // namespace

PyMODINIT_FUNC PyInit_libfusedattn_torch() { return PyModule_Create(&entry_module); }
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
// then for q, k, v: sizes[4], strides[4], gradient strides[4]; then out's permutation to BHSD[4],
// bias kind, bias shape[4], the graph's bias dims[4], dBias (0/1), max_logit (0/1), the aux tensor count, the scalar
// count and each scalar's type (ScalarType). scale: what a pre-scale bias is multiplied by. Its id, or -1.
int64_t fusedattn_torch_plan(int64_t forward, int64_t backward, const int64_t *shape, int64_t count, double scale) {
    constexpr int64_t kFixed = 4 + 4 + 4 + 3 + 3 * 12 + 4 + 1 + 4 + 4 + 1 + 1 + 1 + 1;
    if (count < kFixed || count != kFixed + shape[kFixed - 1]) {
        fusedattn_error = "expected " + std::to_string(kFixed) + " shape entries and one per scalar, got " +
                          std::to_string(count);
        return -1;
    }
    auto plan = std::make_shared<TorchPlan>();
    plan->forward = forward;
    plan->backward = backward;
    plan->scale = scale;
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
    plan->to_bhsd = take(4);
    plan->bias_kind = *next++;
    plan->bias_shape = take(4);
    plan->bias_dims = take(4);
    plan->bias_grad = *next++ != 0;
    plan->max_logit = *next++ != 0;
    plan->aux_count = *next++;
    int64_t scalars = *next++;
    plan->scalar_types = take(scalars);
    return torch_plans().add(plan);
}

// Makes plan `id` a padded or THD plan (before Python hands its id out). values: ragged, padded
// offsets, batch, the table's width, rows and flag row, the longest query and key sequences, Sq, Skv,
// rows per fix-up program, the table kernel's programs, the number of ragged offsets, then (unit, side) for each, then the table row
// of each forward sequence slot and of each backward one (-1: none). 0 on success.
int fusedattn_torch_sequences(int64_t id, const int64_t *values, int64_t count) {
    constexpr int64_t kFixed = 13;
    if (count < kFixed || count != kFixed + 2 * values[kFixed - 1] + kForwardSequenceSlots + kBackwardSequenceSlots) {
        fusedattn_error = "sequence plan: unexpected number of values (" + std::to_string(count) + ")";
        return 1;
    }
    auto plan = torch_plans().find(id);
    if (plan == nullptr) {
        fusedattn_error = "sequence plan: no torch plan " + std::to_string(id);
        return 1;
    }
    auto sequences = std::make_shared<SequencePlan>();
    const int64_t *next = values;
    sequences->ragged = *next++ != 0;
    sequences->padded_offsets = *next++ != 0;
    for (int64_t *field : {&sequences->batch, &sequences->width, &sequences->rows, &sequences->flag_row,
                           &sequences->limit_q, &sequences->limit_kv, &sequences->seqlen_q, &sequences->seqlen_kv,
                           &sequences->rows_per_program, &sequences->table_programs}) {
        *field = *next++;
    }
    int64_t ragged_offsets = *next++;
    for (int64_t i = 0; i < ragged_offsets; ++i) {
        sequences->units.push_back(*next++);
        sequences->sides.push_back(*next++);
    }
    sequences->forward_rows.assign(next, next + kForwardSequenceSlots);
    next += kForwardSequenceSlots;
    sequences->backward_rows.assign(next, next + kBackwardSequenceSlots);
    plan->sequences = sequences;
    return 0;
}

// Gives plan `id`'s sequence plan its kernel `which` (enum SequenceKernel): a cubin of `size` bytes,
// its function's name, warps and dynamic shared memory bytes. 0 on success.
int fusedattn_torch_sequence_kernel(int64_t id, int64_t which, const char *image, int64_t size, const char *name,
                                    int64_t warps, int64_t shared) {
    auto plan = torch_plans().find(id);
    if (plan == nullptr || plan->sequences == nullptr || which < 0 || which >= kSequenceKernels) {
        fusedattn_error = "sequence kernel: no sequence plan " + std::to_string(id) + " or no kernel " +
                          std::to_string(which);
        return 1;
    }
    plan->sequences->kernels[which] = std::make_unique<fusedattn_native::TritonKernel>(
        std::string(image, static_cast<size_t>(size)), name, static_cast<int>(warps), static_cast<int>(shared));
    return 0;
}

// Gives plan `id` its kernel for rows a score_mod left without keys (before Python hands its id out): a
// cubin of `size` bytes, its function's name, warps, dynamic shared memory bytes and the LSE rows each
// program visits. 0 on success.
int fusedattn_torch_empty_rows_kernel(int64_t id, const char *image, int64_t size, const char *name, int64_t warps,
                                      int64_t shared, int64_t rows_per_program) {
    auto plan = torch_plans().find(id);
    if (plan == nullptr || rows_per_program <= 0) {
        fusedattn_error = "empty-rows kernel: no torch plan " + std::to_string(id);
        return 1;
    }
    plan->empty_rows = std::make_unique<fusedattn_native::TritonKernel>(
        std::string(image, static_cast<size_t>(size)), name, static_cast<int>(warps), static_cast<int>(shared));
    plan->empty_rows_per_program = rows_per_program;
    return 0;
}

// Sets the torch plans' bound (when capacity > 0); the number of plans held.
int64_t fusedattn_torch_bounds(int64_t capacity) {
    if (capacity > 0) torch_plans().set_capacity(capacity);
    return torch_plans().size();
}

}  // extern "C"

#pragma GCC visibility pop
