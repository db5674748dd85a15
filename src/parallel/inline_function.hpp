// InlineFunction: a move-only callable holder that keeps callables of up to N bytes inside itself.
//
// The comm queue makes three closures per operation (its start, its poll, or a blocking body).
// std::function keeps anything larger than two pointers on the heap, and every one of those
// closures is larger (an operation's description alone is ~56 bytes), so a 1 KiB send/recv pair
// paid six allocations and frees, a measurable part of its ~1 us (docs/parallel.md "Small
// messages without hand-offs"). Callables larger than N, or whose move may throw, still go on the
// heap, so any callable works; the inline case is the one the comm backends hit.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace strata::detail {

template <typename Sig, std::size_t N = 128>
class InlineFunction;

template <typename R, typename... Args, std::size_t N>
class InlineFunction<R(Args...), N> {
 public:
  InlineFunction() = default;
  InlineFunction(std::nullptr_t) {}  // NOLINT: as std::function

  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, InlineFunction> && std::is_invocable_r_v<R, D&, Args...>>>
  InlineFunction(F&& f) {  // NOLINT: implicit, as std::function
    if constexpr (fits<D>()) {
      ::new (static_cast<void*>(storage_)) D(std::forward<F>(f));
      ops_ = &inline_ops<D>;
    } else {
      *reinterpret_cast<D**>(storage_) = new D(std::forward<F>(f));
      ops_ = &heap_ops<D>;
    }
  }

  InlineFunction(InlineFunction&& o) noexcept { take(o); }
  InlineFunction& operator=(InlineFunction&& o) noexcept {
    if (this != &o) {
      reset();
      take(o);
    }
    return *this;
  }
  InlineFunction& operator=(std::nullptr_t) noexcept {
    reset();
    return *this;
  }
  InlineFunction(const InlineFunction&) = delete;
  InlineFunction& operator=(const InlineFunction&) = delete;
  ~InlineFunction() { reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  R operator()(Args... args) { return ops_->call(storage_, std::forward<Args>(args)...); }

 private:
  struct Ops {
    R (*call)(void* self, Args&&... args);
    // Move-constructs the callable held at `from` into `to` and destroys the one at `from`.
    void (*relocate)(void* from, void* to);
    void (*destroy)(void* self);
  };

  template <typename D>
  static constexpr bool fits() {
    return sizeof(D) <= N && alignof(D) <= alignof(std::max_align_t) && std::is_nothrow_move_constructible_v<D>;
  }

  template <typename D>
  static constexpr Ops inline_ops{
      [](void* self, Args&&... args) -> R { return (*static_cast<D*>(self))(std::forward<Args>(args)...); },
      [](void* from, void* to) {
        ::new (to) D(std::move(*static_cast<D*>(from)));
        static_cast<D*>(from)->~D();
      },
      [](void* self) { static_cast<D*>(self)->~D(); },
  };
  template <typename D>
  static constexpr Ops heap_ops{
      [](void* self, Args&&... args) -> R { return (**static_cast<D**>(self))(std::forward<Args>(args)...); },
      [](void* from, void* to) { *static_cast<D**>(to) = *static_cast<D**>(from); },
      [](void* self) { delete *static_cast<D**>(self); },
  };

  void take(InlineFunction& o) noexcept {
    if (o.ops_ == nullptr) return;
    o.ops_->relocate(o.storage_, storage_);
    ops_ = o.ops_;
    o.ops_ = nullptr;
  }
  void reset() noexcept {
    if (ops_ == nullptr) return;
    ops_->destroy(storage_);
    ops_ = nullptr;
  }

  alignas(std::max_align_t) unsigned char storage_[N < sizeof(void*) ? sizeof(void*) : N];
  const Ops* ops_ = nullptr;
};

}  // namespace strata::detail
