// A registry of objects by id with a bound, shared by the launch core (its plans) and the torch
// operator (its plans): no cuDNN or torch here, so both libraries can include it.

#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace fusedattn_native {

// Objects by id, at most `capacity` of them: adding one past the bound drops the least recently
// added-or-found. Holders of a shared_ptr keep theirs alive.
template <typename T>
class Bounded {
   public:
    // Adds `item` under a new id (counting from 0); the id.
    int64_t add(std::shared_ptr<T> item) {
        std::lock_guard<std::mutex> lock(mutex_);
        int64_t id = next_id_++;
        insert(id, std::move(item));
        return id;
    }

    // Adds `item` under the caller's `key` (a content digest) unless that key is held; the key.
    int64_t add(int64_t key, std::shared_ptr<T> item) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = items_.find(key);
        if (found != items_.end()) {
            order_.splice(order_.begin(), order_, found->second.position);
        } else {
            insert(key, std::move(item));
        }
        return key;
    }

    std::shared_ptr<T> find(int64_t id) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = items_.find(id);
        if (found == items_.end()) return nullptr;
        order_.splice(order_.begin(), order_, found->second.position);
        return found->second.item;
    }

    void set_capacity(int64_t capacity) {
        std::lock_guard<std::mutex> lock(mutex_);
        capacity_ = std::max<int64_t>(1, capacity);
        shrink();
    }

    int64_t size() {
        std::lock_guard<std::mutex> lock(mutex_);
        return static_cast<int64_t>(items_.size());
    }

   private:
    void insert(int64_t id, std::shared_ptr<T> item) {
        order_.push_front(id);
        items_[id] = {std::move(item), order_.begin()};
        shrink();
    }
    void shrink() {
        while (static_cast<int64_t>(items_.size()) > capacity_) {
            items_.erase(order_.back());
            order_.pop_back();
        }
    }
    struct Entry {
        std::shared_ptr<T> item;
        typename std::list<int64_t>::iterator position;
    };
    std::mutex mutex_;
    std::unordered_map<int64_t, Entry> items_;
    std::list<int64_t> order_;  // most recently used first
    int64_t next_id_ = 0;
    int64_t capacity_ = 4096;
};

}  // namespace fusedattn_native
