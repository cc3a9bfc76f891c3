//! The judge's prompts, as data: minijinja templates with defaults shipped in the crate
//! (`src/judge/prompts/*.j2`) and replaceable from the job config.
//!
//! Every template renders the content of one user message. Turn prompts (personal evaluation and
//! the OPD hint judge) see `response`, `next_state` and `next_state_role`; step prompts (terminal,
//! GUI, SWE, tool-call) see `task`, `history`, `step_index`, `step` and `result`, and the same
//! structured: `results` (the result message by message) and `messages` (the episode before the
//! step, whole). Undefined variables are errors, and a replacement template is validated when
//! the set is built: it must compile, render on a sample, and show the material it is meant to
//! judge, verbatim or as JSON strings (`tojson`, for a judge that parses what it is sent).

use minijinja::{Environment, UndefinedBehavior};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Which prompt to render; each kind has its own template and allowed score set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptKind {
    /// Personal-agent binary evaluation: `\boxed{1|-1|0}`.
    PersonalEval,
    /// OPD hint judge: `\boxed{1}` plus `[HINT_START]..[HINT_END]`, or `\boxed{-1}`.
    Hint,
    /// Terminal-agent step judge: `\boxed{1|-1}`.
    StepTerminal,
    /// GUI-agent step judge: `\boxed{1|-1}`.
    StepGui,
    /// SWE-agent step judge: `\boxed{1|-1}`.
    StepSwe,
    /// Tool-call-agent step judge: `\boxed{1|-1}`.
    StepToolCall,
}

impl PromptKind {
    /// All kinds.
    pub const ALL: [PromptKind; 6] = [
        Self::PersonalEval,
        Self::Hint,
        Self::StepTerminal,
        Self::StepGui,
        Self::StepSwe,
        Self::StepToolCall,
    ];

    /// The template's name (also its key in [`PromptOverrides`]).
    pub fn name(self) -> &'static str {
        match self {
            Self::PersonalEval => "personal_eval",
            Self::Hint => "hint",
            Self::StepTerminal => "step_terminal",
            Self::StepGui => "step_gui",
            Self::StepSwe => "step_swe",
            Self::StepToolCall => "step_tool_call",
        }
    }

    /// The scores this prompt allows; any other boxed digit is a failed vote.
    pub fn allowed_scores(self) -> &'static [i8] {
        match self {
            Self::PersonalEval => &[1, -1, 0],
            _ => &[1, -1],
        }
    }

    /// Whether the prompt judges a turn (vs. a step of a general agent).
    pub fn is_turn(self) -> bool {
        matches!(self, Self::PersonalEval | Self::Hint)
    }

    fn default_template(self) -> &'static str {
        match self {
            Self::PersonalEval => include_str!("prompts/personal_eval.j2"),
            Self::Hint => include_str!("prompts/hint.j2"),
            Self::StepTerminal => include_str!("prompts/step_terminal.j2"),
            Self::StepGui => include_str!("prompts/step_gui.j2"),
            Self::StepSwe => include_str!("prompts/step_swe.j2"),
            Self::StepToolCall => include_str!("prompts/step_tool_call.j2"),
        }
    }
}

/// Replacement templates from the job config (`[judge.prompts]`); `None` keeps the default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptOverrides {
    /// Personal evaluation template.
    pub personal_eval: Option<String>,
    /// OPD hint judge template.
    pub hint: Option<String>,
    /// Terminal step judge template.
    pub step_terminal: Option<String>,
    /// GUI step judge template.
    pub step_gui: Option<String>,
    /// SWE step judge template.
    pub step_swe: Option<String>,
    /// Tool-call step judge template.
    pub step_tool_call: Option<String>,
}

impl PromptOverrides {
    fn get(&self, kind: PromptKind) -> Option<&str> {
        match kind {
            PromptKind::PersonalEval => self.personal_eval.as_deref(),
            PromptKind::Hint => self.hint.as_deref(),
            PromptKind::StepTerminal => self.step_terminal.as_deref(),
            PromptKind::StepGui => self.step_gui.as_deref(),
            PromptKind::StepSwe => self.step_swe.as_deref(),
            PromptKind::StepToolCall => self.step_tool_call.as_deref(),
        }
    }
}

/// What a turn prompt judges: the assistant's output and the next state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnMaterial {
    /// The assistant's response text `a_t` (as the judge should read it).
    pub response: String,
    /// The next state `s_{t+1}`: the next user or tool message.
    pub next_state: String,
    /// The next state's role (`user`, `tool`, …).
    pub next_state_role: String,
}

/// What a step prompt judges: one step of a general agent's episode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMaterial {
    /// The task statement.
    pub task: String,
    /// A summary of the steps so far.
    pub history: String,
    /// The step's index in the episode.
    pub step_index: u32,
    /// The step's action (command, click, edit, tool call).
    pub step: String,
    /// The step's result (the next state).
    pub result: String,
    /// The step's result message by message: each next-state message's text (`result` is
    /// these joined by blank lines).
    #[serde(default)]
    pub results: Vec<String>,
    /// The episode's messages before the step, whole (`history` is their shortened summary).
    #[serde(default)]
    pub messages: Vec<StepMessage>,
}

/// One message of an episode as a step prompt sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its text.
    pub content: String,
}

/// The material a prompt is rendered with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Material {
    /// For [`PromptKind::PersonalEval`] and [`PromptKind::Hint`].
    Turn(TurnMaterial),
    /// For the step kinds.
    Step(StepMaterial),
}

impl Material {
    /// The text scripted rules look at: the next state of a turn, the result of a step.
    pub fn subject(&self) -> &str {
        match self {
            Self::Turn(t) => &t.next_state,
            Self::Step(s) => &s.result,
        }
    }

    /// The action being judged: the response of a turn, the action of a step.
    pub fn action(&self) -> &str {
        match self {
            Self::Turn(t) => &t.response,
            Self::Step(s) => &s.step,
        }
    }
}

/// Errors building or rendering prompts.
#[derive(Debug, Error)]
pub enum PromptError {
    /// A template does not compile.
    #[error("judge prompt template `{name}` is invalid: {source}")]
    Compile {
        /// Template name.
        name: &'static str,
        /// The minijinja error.
        #[source]
        source: minijinja::Error,
    },
    /// A template fails to render (e.g. it uses an undefined variable).
    #[error("judge prompt template `{name}` failed to render: {source}")]
    Render {
        /// Template name.
        name: &'static str,
        /// The minijinja error (its message names the cause, e.g. an undefined value).
        #[source]
        source: minijinja::Error,
    },
    /// A template renders but never shows one of the values it must judge.
    #[error(
        "judge prompt template `{name}` never shows `{{{{ {variable} }}}}`, which it must judge"
    )]
    MissingVariable {
        /// Template name.
        name: &'static str,
        /// The variable it must use.
        variable: &'static str,
    },
    /// Material of the wrong shape for the prompt kind.
    #[error("prompt `{name}` needs {expected} material")]
    WrongMaterial {
        /// Template name.
        name: &'static str,
        /// `"turn"` or `"step"`.
        expected: &'static str,
    },
}

/// The validated templates of every prompt kind.
#[derive(Debug)]
pub struct PromptSet {
    env: Environment<'static>,
}

impl PromptSet {
    /// The crate's default prompts.
    pub fn defaults() -> Self {
        Self::new(&PromptOverrides::default()).expect("the crate's default prompts are valid")
    }

    /// Builds the set, replacing the defaults named in `overrides`, and validates every template
    /// by rendering it on sample material.
    pub fn new(overrides: &PromptOverrides) -> Result<Self, PromptError> {
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        // Templates are plain text prompts, not HTML: no auto-escaping.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        for kind in PromptKind::ALL {
            let source = overrides
                .get(kind)
                .unwrap_or(kind.default_template())
                .to_string();
            env.add_template_owned(kind.name(), source)
                .map_err(|source| PromptError::Compile {
                    name: kind.name(),
                    source,
                })?;
        }
        let set = Self { env };
        for kind in PromptKind::ALL {
            set.validate(kind)?;
        }
        Ok(set)
    }

    fn validate(&self, kind: PromptKind) -> Result<(), PromptError> {
        const ACTION: &str = "\u{1}sample-action\u{1}";
        const SUBJECT: &str = "\u{1}sample-subject\u{1}";
        let (material, required) = if kind.is_turn() {
            (
                Material::Turn(TurnMaterial {
                    response: ACTION.into(),
                    next_state: SUBJECT.into(),
                    next_state_role: "user".into(),
                }),
                [("response", ACTION), ("next_state", SUBJECT)],
            )
        } else {
            (
                Material::Step(StepMaterial {
                    task: "sample task".into(),
                    history: "sample history".into(),
                    step_index: 0,
                    step: ACTION.into(),
                    result: SUBJECT.into(),
                    results: vec![SUBJECT.into()],
                    messages: Vec::new(),
                }),
                [("step", ACTION), ("result", SUBJECT)],
            )
        };
        let text = self.render(kind, &material)?;
        for (variable, value) in required {
            // Shown verbatim, or as a JSON string (`tojson`) for a judge that reads JSON.
            let json = serde_json::to_string(value).expect("a string serializes");
            if !text.contains(value) && !text.contains(&json) {
                return Err(PromptError::MissingVariable {
                    name: kind.name(),
                    variable,
                });
            }
        }
        Ok(())
    }

    /// Renders `kind` with `material` into the judge's user message.
    pub fn render(&self, kind: PromptKind, material: &Material) -> Result<String, PromptError> {
        let name = kind.name();
        match (kind.is_turn(), material) {
            (true, Material::Step(_)) => {
                return Err(PromptError::WrongMaterial {
                    name,
                    expected: "turn",
                })
            }
            (false, Material::Turn(_)) => {
                return Err(PromptError::WrongMaterial {
                    name,
                    expected: "step",
                })
            }
            _ => {}
        }
        let template = self
            .env
            .get_template(name)
            .map_err(|source| PromptError::Compile { name, source })?;
        template
            .render(material)
            .map_err(|source| PromptError::Render { name, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn() -> Material {
        Material::Turn(TurnMaterial {
            response: "Here is the <b>file</b> list".into(),
            next_state: "No, I asked for hidden files too".into(),
            next_state_role: "user".into(),
        })
    }

    #[test]
    fn defaults_render_their_material_verbatim() {
        let set = PromptSet::defaults();
        let text = set.render(PromptKind::PersonalEval, &turn()).unwrap();
        assert!(
            text.contains("Here is the <b>file</b> list"),
            "no HTML escaping"
        );
        assert!(text.contains("No, I asked for hidden files too"));
        assert!(text.contains("\\boxed{1}") && text.contains("\\boxed{0}"));
        let hint = set.render(PromptKind::Hint, &turn()).unwrap();
        assert!(hint.contains("[HINT_START]") && hint.contains("[HINT_END]"));
        let step = Material::Step(StepMaterial {
            task: "count lines".into(),
            history: "ran ls".into(),
            step_index: 3,
            step: "wc -l a.txt".into(),
            result: "12 a.txt".into(),
            results: vec!["12 a.txt".into()],
            messages: Vec::new(),
        });
        for kind in [
            PromptKind::StepTerminal,
            PromptKind::StepGui,
            PromptKind::StepSwe,
            PromptKind::StepToolCall,
        ] {
            let text = set.render(kind, &step).unwrap();
            assert!(
                text.contains("wc -l a.txt")
                    && text.contains("12 a.txt")
                    && text.contains("count lines")
            );
            assert!(text.contains("Step 3"));
        }
    }

    #[test]
    fn material_must_match_the_kind() {
        let set = PromptSet::defaults();
        assert!(matches!(
            set.render(PromptKind::StepGui, &turn()),
            Err(PromptError::WrongMaterial {
                expected: "step",
                ..
            })
        ));
    }

    #[test]
    fn overrides_replace_defaults() {
        let o = PromptOverrides {
            hint: Some("R={{ response }} N={{ next_state }} ({{ next_state_role }})".into()),
            ..Default::default()
        };
        let set = PromptSet::new(&o).unwrap();
        assert_eq!(
            set.render(PromptKind::Hint, &turn()).unwrap(),
            "R=Here is the <b>file</b> list N=No, I asked for hidden files too (user)"
        );
    }

    #[test]
    fn bad_overrides_are_clear_errors() {
        let compile = PromptOverrides {
            personal_eval: Some("{% if %}".into()),
            ..Default::default()
        };
        let e = PromptSet::new(&compile).unwrap_err();
        assert!(
            matches!(
                e,
                PromptError::Compile {
                    name: "personal_eval",
                    ..
                }
            ),
            "{e}"
        );

        let undefined = PromptOverrides {
            step_swe: Some("{{ step }} {{ result }} {{ nope }}".into()),
            ..Default::default()
        };
        let e = PromptSet::new(&undefined).unwrap_err();
        assert!(
            matches!(
                e,
                PromptError::Render {
                    name: "step_swe",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("step_swe"));

        let missing = PromptOverrides {
            hint: Some("judge {{ response }}".into()),
            ..Default::default()
        };
        let e = PromptSet::new(&missing).unwrap_err();
        assert!(
            matches!(
                e,
                PromptError::MissingVariable {
                    name: "hint",
                    variable: "next_state"
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("{{ next_state }}"), "{e}");
    }

    #[test]
    fn a_step_template_may_send_its_material_as_json() {
        let json = PromptOverrides {
            step_tool_call: Some(
                "{{ {\"step\": step, \"results\": results, \"messages\": messages}|tojson }}"
                    .into(),
            ),
            ..Default::default()
        };
        let set = PromptSet::new(&json).unwrap();
        let material = Material::Step(StepMaterial {
            task: "t".into(),
            history: String::new(),
            step_index: 1,
            step: "print(2+3)".into(),
            result: "exit code: 0\nstdout:\n5\n\nexit code: 1".into(),
            results: vec!["exit code: 0\nstdout:\n5\n".into(), "exit code: 1".into()],
            messages: vec![StepMessage {
                role: "tool".into(),
                content: "<a> & 'b'".into(),
            }],
        });
        let text = set.render(PromptKind::StepToolCall, &material).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["step"], "print(2+3)");
        assert_eq!(back["results"][1], "exit code: 1");
        assert_eq!(back["messages"][0]["content"], "<a> & 'b'");
        // Leaving out the result is still refused.
        let without = PromptOverrides {
            step_tool_call: Some("{{ step|tojson }}".into()),
            ..Default::default()
        };
        assert!(matches!(
            PromptSet::new(&without),
            Err(PromptError::MissingVariable {
                variable: "result",
                ..
            })
        ));
    }
}
