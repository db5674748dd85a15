// libFuzzer target: the config loader on arbitrary JSON text. Any input must give a Config or an
// error status naming the problem; a loaded config must print (to_json) as text that loads again
// to the same printed config.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "strata/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = strata::parse_config(text, "fuzz.json");
  if (!config.ok()) {
    if (config.status().message().empty()) std::abort();  // every error says what is wrong
    return 0;
  }
  const std::string printed = strata::to_json(*config);
  auto again = strata::parse_config(printed, "fuzz-printed.json");
  if (!again.ok() || strata::to_json(*again) != printed) std::abort();
  return 0;
}
