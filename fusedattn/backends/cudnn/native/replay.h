// Replaying a plan's launches from CUDA graphs (launch_core.cc's execute). cuDNN's execute costs the
// host 14 us (forward) to 34 us (backward) a call: it makes, fills and finalizes a variant-pack
// descriptor and runs cuDNN's launch code every time. The same launch captured once into a CUDA graph
// replays for the cost of one cudaGraphLaunch.
//
// A captured launch bakes in its pointers and the values of its pass-by-value scalars, so that is
// its key (the stream is not: a graph launches on any stream of its device). A key's launch is
// captured the second time the key comes, so calls whose buffers never repeat pay for a key and a
// lookup only; a plan whose keys keep changing stops capturing. The launch core finds the runtime's
// entry points (GraphApi) in the CUDA runtime the process loaded, as the frontend finds its own.

#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>

namespace fusedattn_native {

// The CUDA runtime's graph entry points, found once. `ok` is false when one is missing.
struct GraphApi {
    cudaError_t (*is_capturing)(cudaStream_t, cudaStreamCaptureStatus *) = nullptr;
    cudaError_t (*create_stream)(cudaStream_t *, unsigned int) = nullptr;
    cudaError_t (*begin_capture)(cudaStream_t, cudaStreamCaptureMode) = nullptr;
    cudaError_t (*end_capture)(cudaStream_t, cudaGraph_t *) = nullptr;
    cudaError_t (*instantiate)(cudaGraphExec_t *, cudaGraph_t, unsigned long long) = nullptr;
    cudaError_t (*launch)(cudaGraphExec_t, cudaStream_t) = nullptr;
    cudaError_t (*destroy_exec)(cudaGraphExec_t) = nullptr;
    cudaError_t (*destroy_graph)(cudaGraph_t) = nullptr;
    cudaError_t (*last_error)() = nullptr;
    cudaError_t (*synchronize)() = nullptr;
    bool ok = false;
};

// FUSEDATTN_NATIVE_REPLAY=0 turns replays off (every launch goes through cuDNN's execute).
inline bool replay_enabled() {
    static const bool on = [] {
        const char *value = std::getenv("FUSEDATTN_NATIVE_REPLAY");
        return value == nullptr || std::strcmp(value, "0") != 0;
    }();
    return on;
}

// A launch's key: for each pointer in the frontend's order, the pointer itself, or for a host pointer
// to a pass-by-value scalar (value_bytes[j] > 0) the scalar's bytes; then the workspace.
inline void replay_key(void *const *pointers, const std::vector<int8_t> &value_bytes, void *workspace,
                       std::string *key) {
    key->clear();
    for (size_t j = 0; j < value_bytes.size(); ++j) {
        if (value_bytes[j] > 0) {
            key->append(static_cast<const char *>(pointers[j]), value_bytes[j]);
        } else {
            key->append(reinterpret_cast<const char *>(&pointers[j]), sizeof(void *));
        }
    }
    key->append(reinterpret_cast<const char *>(&workspace), sizeof(void *));
}

// One plan's captured launches on one device; used under that device's launch lock.
class Replays {
   public:
    static constexpr size_t kCapacity = 256;        // graphs kept (least recently used go first)
    static constexpr size_t kSightings = 4096;      // keys remembered before their second sighting
    static constexpr int64_t kWindow = 1024;        // launches between checks for churn
    static constexpr int64_t kMostCaptures = 256;   // captures a window may take before replays stop

    explicit Replays(const GraphApi *api) : api_(api) {}
    ~Replays() {
        for (auto &entry : graphs_) api_->destroy_exec(entry.second.exec);
    }
    Replays(const Replays &) = delete;
    Replays &operator=(const Replays &) = delete;

    // The graph held for `key` (nullptr if none). When none is held and this is the key's second
    // sighting, *capture is set: the caller captures the launch and keeps it.
    cudaGraphExec_t find(const std::string &key, bool *capture) {
        *capture = false;
        if (++window_launches_ >= kWindow) {
            if (window_captures_ > kMostCaptures) off = true;
            window_launches_ = window_captures_ = 0;
        }
        auto found = graphs_.find(key);
        if (found != graphs_.end()) {
            found->second.used = ++clock_;
            return found->second.exec;
        }
        if (off) return nullptr;
        if (seen_.size() >= kSightings) seen_.clear();
        auto sighting = seen_.emplace(key, 0).first;
        if (++sighting->second >= 2) {
            seen_.erase(sighting);
            *capture = true;
        }
        return nullptr;
    }

    // Counts one sighting of `key` (its next one captures).
    void sighted(const std::string &key) { seen_[key] = 1; }

    void keep(const std::string &key, cudaGraphExec_t exec) {
        ++window_captures_;
        if (graphs_.size() >= kCapacity) {
            auto oldest = graphs_.begin();
            for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
                if (it->second.used < oldest->second.used) oldest = it;
            }
            api_->destroy_exec(oldest->second.exec);
            graphs_.erase(oldest);
        }
        graphs_[key] = {exec, ++clock_};
    }

    size_t size() const { return graphs_.size(); }

    bool off = false;  // no more captures for this plan here (one failed, or its keys churn)

   private:
    struct Entry {
        cudaGraphExec_t exec;
        uint64_t used;
    };
    const GraphApi *api_;
    std::unordered_map<std::string, Entry> graphs_;
    std::unordered_map<std::string, int> seen_;
    uint64_t clock_ = 0;
    int64_t window_launches_ = 0;
    int64_t window_captures_ = 0;
};

}  // namespace fusedattn_native
