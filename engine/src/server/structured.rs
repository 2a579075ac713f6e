//! The request side of structured output, as vLLM takes it: `response_format`
//! (`json_object`, `json_schema`), `structured_outputs` (`json`, `regex`, `choice`,
//! `grammar`, `json_object`), the older `guided_*` fields, and chat's `tools` with
//! `tool_choice` `required` or a named function, whose output becomes `tool_calls`.
//! At most one of them per request. The grammar itself is compiled and applied in
//! `runtime::structured`.

use serde_json::{json, Map, Value};

use super::api::{ApiError, Endpoint};
use crate::runtime::structured::Grammar;

/// What a request constrains its output to, and whether that output is a tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredRequest {
    pub grammar: Grammar,
    pub tool: Option<ToolChoice>,
    /// The field it came from, which a grammar that does not compile is reported under.
    pub param: &'static str,
}

/// A tool call the model is made to produce (`tool_choice`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// This function: the output is its arguments.
    Named(String),
    /// One or more calls of the given tools: the output is a JSON list of
    /// `{"name", "parameters"}` (vLLM's form).
    Required,
}

/// Chat's `tools` as a request gives them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatTools {
    /// The list, for the chat template.
    pub tools: Option<Value>,
    /// `tool_choice: "auto"` (the default with tools): the model may call one, in its own
    /// format, which the server's tool-call parser finds (see `tool_parser`).
    pub auto: bool,
    /// `parallel_tool_calls` (default true): false answers one call at most.
    pub parallel: bool,
}

/// The structured output a body asks for (if any), and chat's tools.
pub fn parse(
    body: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(Option<StructuredRequest>, ChatTools), ApiError> {
    let mut found: Vec<(&'static str, Grammar)> = Vec::new();
    if let Some(g) = response_format(body.get("response_format"))? {
        found.push(("response_format", g));
    }
    if let Some(g) = structured_outputs(body.get("structured_outputs"))? {
        found.push(("structured_outputs", g));
    }
    for key in [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            found.push((key, one_kind(key, &key["guided_".len()..], v, true)?));
        }
    }
    let (tool, tools) = tool_choice(body, endpoint)?;
    if let Some((ToolGrammar(g), _)) = &tool {
        found.push(("tool_choice", g.clone()));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|f| f.0).collect();
        return Err(ApiError::bad_request(
            Some(names[1]),
            format!(
                "only one kind of structured output per request, got {}",
                names.join(" and ")
            ),
        ));
    }
    let structured = found.pop().map(|(param, grammar)| StructuredRequest {
        grammar,
        tool: tool.map(|(_, t)| t),
        param,
    });
    Ok((structured, tools))
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_request(Some(param), message)
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema`
/// with its `schema`.
fn response_format(v: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let p = "response_format";
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::json_object(true))),
        Some("json_schema") => {
            let spec = v
                .get("json_schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    bad(p, "response_format of type json_schema needs a json_schema object")
                })?;
            let schema = spec
                .get("schema")
                .filter(|s| !s.is_null())
                .ok_or_else(|| bad(p, "response_format.json_schema needs a schema"))?;
            json_schema(p, schema.clone(), true).map(Some)
        }
        Some(other) => Err(bad(
            p,
            format!("response_format type {other:?} is not supported by this server (text, json_object, json_schema are)"),
        )),
        None => Err(bad(p, "response_format needs a type")),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`, with `disable_any_whitespace`.
fn structured_outputs(v: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let p = "structured_outputs";
    let Value::Object(m) = v else {
        return Err(bad(p, "structured_outputs must be an object"));
    };
    let any_whitespace = match m.get("disable_any_whitespace") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => return Err(bad(p, "disable_any_whitespace must be a boolean")),
    };
    let mut kinds = Vec::new();
    for (key, value) in m {
        if value.is_null() || key == "disable_any_whitespace" {
            continue;
        }
        match key.as_str() {
            "json" | "regex" | "choice" | "grammar" => {
                kinds.push(one_kind(p, key, value, any_whitespace)?)
            }
            "json_object" => match value {
                Value::Bool(true) => kinds.push(Grammar::json_object(any_whitespace)),
                Value::Bool(false) => {}
                _ => return Err(bad(p, "json_object must be a boolean")),
            },
            // vLLM's switches that change nothing here, at their default.
            "disable_fallback" | "disable_additional_properties" if value == &json!(false) => {}
            "whitespace_pattern" | "structural_tag" | "disable_fallback"
            | "disable_additional_properties" => {
                return Err(bad(
                    p,
                    format!("structured_outputs.{key} is not supported by this server"),
                ))
            }
            _ => {
                return Err(bad(
                    p,
                    format!("structured_outputs has no field {key:?} (json, regex, choice, grammar, json_object)"),
                ))
            }
        }
    }
    match kinds.len() {
        0 => Err(bad(
            p,
            "structured_outputs needs one of json, regex, choice, grammar, json_object",
        )),
        1 => Ok(kinds.pop()),
        _ => Err(bad(
            p,
            "structured_outputs takes only one of json, regex, choice, grammar, json_object",
        )),
    }
}

/// One constraint by kind: `json` (a schema, or its JSON text), `regex`, `choice` (a list
/// of strings) or `grammar` (Lark).
fn one_kind(param: &str, kind: &str, v: &Value, any_whitespace: bool) -> Result<Grammar, ApiError> {
    let string = |what: &str| {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(param, format!("{kind} must be {what}")))
    };
    match kind {
        "json" => {
            let schema = match v {
                Value::String(s) => serde_json::from_str(s)
                    .map_err(|e| bad(param, format!("{kind} is not valid JSON: {e}")))?,
                other => other.clone(),
            };
            json_schema(param, schema, any_whitespace)
        }
        "regex" => Ok(Grammar::Regex(string("a string")?)),
        "grammar" => Ok(Grammar::Lark(string("a string (a Lark grammar)")?)),
        "choice" => {
            let list = v
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| bad(param, "choice must be a non-empty list of strings"))?;
            list.iter()
                .map(|c| {
                    c.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad(param, "choice must be a non-empty list of strings"))
                })
                .collect::<Result<_, _>>()
                .map(Grammar::Choice)
        }
        _ => unreachable!("one of the kinds above"),
    }
}

fn json_schema(param: &str, schema: Value, any_whitespace: bool) -> Result<Grammar, ApiError> {
    if !schema.is_object() && !schema.is_boolean() {
        return Err(bad(param, "a JSON schema must be an object or a boolean"));
    }
    Ok(Grammar::JsonSchema {
        schema,
        any_whitespace,
    })
}

/// A tool call's grammar (kept apart so that `parse` can name it among the others).
struct ToolGrammar(Grammar);

/// Chat's `tools` and `tool_choice`. `none` (the default without tools) leaves the output
/// free; `auto` (the default with tools) too, for the server's tool-call parser to read.
#[allow(clippy::type_complexity)]
fn tool_choice(
    body: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(Option<(ToolGrammar, ToolChoice)>, ChatTools), ApiError> {
    let tools = body.get("tools").filter(|v| !v.is_null());
    let choice = body.get("tool_choice").filter(|v| !v.is_null());
    if endpoint == Endpoint::Completions {
        let used = [
            ("tools", tools.is_some_and(|t| t != &json!([]))),
            ("tool_choice", choice.is_some_and(|c| c != "none")),
        ];
        if let Some((key, _)) = used.iter().find(|(_, used)| *used) {
            return Err(bad(key, format!("{key} is only for chat completions")));
        }
        return Ok((None, ChatTools::default()));
    }
    let tools = tool_list(tools)?;
    let functions = function_tools(&tools)?;
    // (Read whatever the choice: `none` and a named function make at most one call.)
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                "parallel_tool_calls",
                "parallel_tool_calls must be true or false",
            ))
        }
    };
    let tools_value = (!tools.is_empty()).then(|| Value::Array(tools));
    let default = if functions.is_empty() { "none" } else { "auto" };
    let choice = choice.cloned().unwrap_or_else(|| json!(default));
    // As OpenAI and vLLM refuse it: a choice other than none with nothing to call.
    if functions.is_empty() && choice != "none" {
        return Err(bad(
            "tool_choice",
            "When using `tool_choice`, `tools` must be set.",
        ));
    }
    let auto = choice == "auto";
    let picked = match &choice {
        Value::String(s) if s == "none" || s == "auto" => None,
        Value::String(s) if s == "required" => {
            let grammar = required_grammar(&functions, parallel)?;
            Some((ToolGrammar(grammar), ToolChoice::Required))
        }
        Value::Object(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            let Some((_, params)) = functions.iter().find(|(n, _)| n == name) else {
                return Err(bad(
                    "tool_choice",
                    format!("Tool '{name}' has not been passed in `tools`."),
                ));
            };
            let schema = params.clone().unwrap_or_else(empty_object);
            Some((
                ToolGrammar(json_schema("tool_choice", schema, true)?),
                ToolChoice::Named(name.to_string()),
            ))
        }
        other => {
            return Err(bad(
                "tool_choice",
                format!("tool_choice must be \"none\", \"auto\", \"required\" or a named function, not {other}"),
            ))
        }
    };
    let tools = ChatTools {
        tools: tools_value,
        auto,
        parallel,
    };
    Ok((picked, tools))
}

/// `tools` as a list (absent: none).
fn tool_list(tools: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    match tools {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => Ok(list.clone()),
        Some(_) => Err(bad("tools", "tools must be a list")),
    }
}

/// A request's `tools` as the chat template reads them (`/tokenize` of a chat: the prompt
/// the same conversation and tools get through `/v1/chat/completions`), each checked.
pub fn template_tools(body: &Map<String, Value>) -> Result<Option<Value>, ApiError> {
    let tools = tool_list(body.get("tools"))?;
    function_tools(&tools)?;
    Ok((!tools.is_empty()).then_some(Value::Array(tools)))
}

/// Each tool's function name and parameter schema.
fn function_tools(tools: &[Value]) -> Result<Vec<(String, Option<Value>)>, ApiError> {
    let mut functions = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let f = t
            .get("function")
            .filter(|_| t.get("type").and_then(Value::as_str) == Some("function"))
            .filter(|f| f.get("name").is_some_and(Value::is_string))
            .ok_or_else(|| {
                bad(
                    "tools",
                    format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"),
                )
            })?;
        let params = match f.get("parameters") {
            None | Some(Value::Null) => None,
            Some(p) if p.is_object() => Some(p.clone()),
            Some(_) => {
                return Err(bad(
                    "tools",
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                ))
            }
        };
        functions.push((f["name"].as_str().unwrap_or_default().to_string(), params));
    }
    Ok(functions)
}

fn empty_object() -> Value {
    json!({"type": "object", "properties": {}})
}

/// vLLM's schema for `tool_choice: "required"`: a non-empty list of calls (one, with
/// `parallel_tool_calls: false`), each one of the tools by name with its parameters and
/// nothing else; the tools' `$defs` are hoisted to the top.
fn required_grammar(
    functions: &[(String, Option<Value>)],
    parallel: bool,
) -> Result<Grammar, ApiError> {
    let mut defs = Map::new();
    let mut any_of = Vec::new();
    for (name, params) in functions {
        let mut params = params.clone().unwrap_or_else(empty_object);
        if let Some(Value::Object(d)) = params.as_object_mut().and_then(|p| p.remove("$defs")) {
            for (k, v) in d {
                if defs.get(&k).is_some_and(|old| old != &v) {
                    return Err(bad(
                        "tools",
                        format!("tools define $defs.{k} in two different ways"),
                    ));
                }
                defs.insert(k, v);
            }
        }
        // No other keys (vLLM's schema allows them: a weak model then never closes a call).
        any_of.push(json!({
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": false,
        }));
    }
    let mut schema = json!({"type": "array", "minItems": 1,
                            "items": {"type": "object", "anyOf": any_of}});
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    json_schema("tool_choice", schema, true)
}

/// The `tool_calls` of a finished choice whose text followed `tool`'s grammar, with ids
/// from `next_id`; `None` when the text is not a whole call (generation was cut short).
pub fn tool_calls(
    tool: &ToolChoice,
    text: &str,
    mut next_id: impl FnMut() -> String,
) -> Option<Vec<Value>> {
    let call = |id: String, name: &str, arguments: String| json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}});
    match tool {
        ToolChoice::Named(name) => {
            serde_json::from_str::<Value>(text).ok()?;
            Some(vec![call(next_id(), name, text.to_string())])
        }
        ToolChoice::Required => {
            let list: Vec<Value> = serde_json::from_str(text).ok()?;
            list.iter()
                .map(|c| {
                    let name = c.get("name")?.as_str()?;
                    let args = super::tool_parser::python_json(c.get("parameters")?);
                    Some(call(next_id(), name, args))
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str, e: Endpoint) -> Result<Option<StructuredRequest>, ApiError> {
        let body: Map<String, Value> = serde_json::from_str(s).unwrap();
        parse(&body, e).map(|p| p.0)
    }

    #[test]
    fn each_way_of_asking_gives_its_grammar() {
        let chat = Endpoint::Chat;
        let g = |s: &str| parse_str(s, chat).unwrap().map(|r| r.grammar);
        assert_eq!(g(r#"{"response_format": {"type": "text"}}"#), None);
        assert_eq!(
            g(r#"{"response_format": {"type": "json_object"}}"#),
            Some(Grammar::json_object(true))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let want = Some(Grammar::JsonSchema {
            schema: schema.clone(),
            any_whitespace: true,
        });
        let rf = json!({"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": schema, "strict": true}}});
        assert_eq!(g(&rf.to_string()), want);
        let so = json!({"structured_outputs": {"json": schema.to_string()}});
        assert_eq!(g(&so.to_string()), want);
        assert_eq!(g(&json!({"guided_json": schema}).to_string()), want);
        assert_eq!(
            g(r#"{"structured_outputs": {"regex": "a+", "disable_any_whitespace": true}}"#),
            Some(Grammar::Regex("a+".into()))
        );
        assert_eq!(
            g(r#"{"structured_outputs": {"json_object": true, "disable_any_whitespace": true}}"#),
            Some(Grammar::json_object(false))
        );
        assert_eq!(
            g(r#"{"guided_choice": ["x", "y"]}"#),
            Some(Grammar::Choice(vec!["x".into(), "y".into()]))
        );
    }

    #[test]
    fn tools_required_and_named() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}},
                             "required": ["city"], "$defs": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "now"}}
        ]);
        let body = json!({"tools": tools, "tool_choice": "required"});
        let r = parse_str(&body.to_string(), Endpoint::Chat)
            .unwrap()
            .unwrap();
        assert_eq!(r.tool, Some(ToolChoice::Required));
        let Grammar::JsonSchema { schema, .. } = &r.grammar else {
            panic!("{r:?}")
        };
        assert_eq!(schema["$defs"]["city"], json!({"type": "string"}));
        assert_eq!(
            schema["items"]["anyOf"][1]["properties"]["parameters"],
            empty_object()
        );
        assert_eq!(schema.get("maxItems"), None, "parallel calls by default");
        // `parallel_tool_calls: false`: at most one call (OpenAI's meaning).
        let one = json!({"tools": tools, "tool_choice": "required", "parallel_tool_calls": false});
        let r = parse_str(&one.to_string(), Endpoint::Chat)
            .unwrap()
            .unwrap();
        let Grammar::JsonSchema { schema, .. } = &r.grammar else {
            panic!("{r:?}")
        };
        assert_eq!(
            (&schema["minItems"], &schema["maxItems"]),
            (&json!(1), &json!(1))
        );
        let bad = json!({"tools": tools, "tool_choice": "required", "parallel_tool_calls": "no"});
        let e = parse_str(&bad.to_string(), Endpoint::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("parallel_tool_calls"));
        let body = json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "now"}}});
        let r = parse_str(&body.to_string(), Endpoint::Chat)
            .unwrap()
            .unwrap();
        assert_eq!(r.tool, Some(ToolChoice::Named("now".into())));
        // Tools with no choice default to "auto": no grammar, the server's parser reads
        // the output (a server without one refuses it, which `serve.rs` tests).
        let tools_of = |body: Value| {
            let body: Map<String, Value> = serde_json::from_value(body).unwrap();
            parse(&body, Endpoint::Chat).unwrap()
        };
        let (grammar, chat) = tools_of(json!({"tools": tools}));
        assert_eq!((grammar, chat.auto), (None, true));
        assert_eq!(chat.tools.as_ref(), Some(&tools));
        assert!(
            tools_of(json!({"tools": tools, "tool_choice": "auto"}))
                .1
                .auto
        );
        let body: Map<String, Value> =
            serde_json::from_value(json!({"tool_choice": "auto"})).unwrap();
        let e = parse(&body, Endpoint::Chat).unwrap_err();
        assert!(e.message.contains("`tools` must be set"), "{}", e.message);
        assert!(
            !tools_of(json!({"tools": tools, "parallel_tool_calls": false}))
                .1
                .parallel
        );
        let (grammar, chat) = tools_of(json!({"tools": tools, "tool_choice": "none"}));
        assert_eq!((grammar, chat.auto), (None, false));
        assert_eq!(
            chat.tools.as_ref(),
            Some(&tools),
            "still shown to the template"
        );
        // The calls come back in OpenAI's form.
        let mut n = 0;
        let mut ids = || {
            n += 1;
            format!("call{n}")
        };
        let calls = tool_calls(
            &ToolChoice::Required,
            r#"[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]"#,
            &mut ids,
        )
        .unwrap();
        assert_eq!(calls[1]["function"]["arguments"], r#"{"city": "Oslo"}"#);
        assert_eq!(calls[1]["id"], "call2");
        assert_eq!(
            tool_calls(&ToolChoice::Required, "[{\"name\"", &mut ids),
            None
        );
    }

    #[test]
    fn mistakes_are_named() {
        let cases = [
            (
                r#"{"response_format": {"type": "json_schema"}}"#,
                "json_schema object",
            ),
            (
                r#"{"response_format": {"type": "structural_tag"}}"#,
                "not supported",
            ),
            (r#"{"structured_outputs": {}}"#, "needs one of"),
            (
                r#"{"structured_outputs": {"regex": "a", "choice": ["b"]}}"#,
                "only one of",
            ),
            (
                r#"{"structured_outputs": {"choice": []}}"#,
                "non-empty list",
            ),
            (r#"{"structured_outputs": {"ebnf": "x"}}"#, "no field"),
            (
                r#"{"guided_regex": "a", "response_format": {"type": "json_object"}}"#,
                "only one kind",
            ),
            (
                r#"{"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}"#,
                "Tool 'g' has not been passed",
            ),
            (
                r#"{"tools": [{"type": "x"}], "tool_choice": "required"}"#,
                "tools[0]",
            ),
            (r#"{"tool_choice": "required"}"#, "`tools` must be set"),
        ];
        for (body, want) in cases {
            let e = parse_str(body, Endpoint::Chat).unwrap_err();
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
        assert_eq!(
            parse_str(r#"{"tools": []}"#, Endpoint::Completions).unwrap(),
            None
        );
        let e = parse_str(r#"{"tools": [{}]}"#, Endpoint::Completions).unwrap_err();
        assert!(e.message.contains("only for chat"), "{}", e.message);
    }
}
