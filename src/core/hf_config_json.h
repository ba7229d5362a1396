// Reading a Hugging Face config.json: the one parser behind the MoE layer's,
// the attention's and the model's from_hf_config_json. Include only from
// sources built with nlohmann/json (CMakeLists.txt: MOELINK_JSON_INCLUDE).
#pragma once

#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "moelink/errors.h"

namespace moelink::detail {

// The language model's object in config.json text: its text_config when
// the file wraps one (multimodal and wrapper configs keep the language
// model's fields there). `who` names the config in errors ("MLAConfig").
inline nlohmann::json parse_hf_config(const std::string& json_text, const char* who) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(std::string("moelink: ") + who + ": config.json is not valid JSON: " +
                          e.what());
  }
  if (!j.is_object())
    throw InvalidArgument(std::string("moelink: ") + who + ": config.json is not a JSON object");
  if (j.contains("text_config") && j["text_config"].is_object() && !j.contains("hidden_size"))
    j = j["text_config"];
  return j;
}

// The first of `keys` that `o` holds as a number; else `fallback`, or, when
// `required`, an InvalidArgument naming every key tried.
inline double hf_number(const nlohmann::json& o, std::initializer_list<const char*> keys,
                        double fallback, bool required, const char* who) {
  for (const char* k : keys)
    if (o.contains(k) && o[k].is_number()) return o[k].get<double>();
  if (required) {
    std::string names;
    for (const char* k : keys) names += (names.empty() ? "" : " or ") + std::string(k);
    throw InvalidArgument(std::string("moelink: ") + who + ": config.json has no " + names);
  }
  return fallback;
}

}  // namespace moelink::detail
