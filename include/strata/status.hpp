// Errors as values. Every fallible Strata call returns a Status or a Result<T>; no exception
// crosses the public API. A Status message names the file, key, tensor or offset involved so a
// user can act on it without a debugger.
#pragma once

#include <cstdint>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace strata {

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,   // bad input from the caller: config value, CLI flag, shape, size
  kNotFound,          // a named thing (file, key, tensor, device) does not exist
  kOutOfMemory,       // a budget (device, pinned, arena region, swap space) is exhausted
  kIoError,           // the OS reported an I/O failure (carries errno text)
  kDataLoss,          // stored bytes are corrupt (checksum mismatch, truncated file)
  kUnavailable,       // a backend or feature is not present in this build or on this machine
  kFailedPrecondition,// the object is in the wrong state for the call
  kInternal,          // a broken invariant inside Strata: a bug
  kDeviceError,       // the accelerator runtime reported an error (kernel, copy, stream)
  kCancelled,         // work was skipped because earlier work on the same queue failed
};

std::string_view to_string(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "CODE: message", or "OK".
  std::string to_string() const;

  // Returns a copy whose message is prefixed with `context: ` (for adding the caller's view).
  Status with_context(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return {}; }
inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status out_of_memory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status device_error(std::string m) { return {StatusCode::kDeviceError, std::move(m)}; }
inline Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }

// A value or the Status that explains why there is none. Holding an OK status without a value
// is impossible by construction.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<T, Status>, "Result<Status> makes no sense");

 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::in_place_index<1>, std::move(status)) {  // NOLINT
    if (std::get<1>(v_).ok()) {
      v_.template emplace<1>(StatusCode::kInternal, "Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return v_.index() == 0; }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<1>(v_);
  }

  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }

  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::get<0>(std::move(v_)); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace strata

// Propagate a non-OK Status from an expression returning Status.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

// `STRATA_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or returns its Status.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_result_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()
