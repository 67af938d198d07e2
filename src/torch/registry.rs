//! Who a convolution belongs to: the converted layers (each a module path, its options and
//! what identifies its calls) and the process-wide switch.
//!
//! A kernel finds the layer of a call by its weight first: the module's own weight parameter
//! (PyTorch's `TensorImpl`, the same object in the forward and in the backward's saved
//! tensors; the layer holds a reference to it, so its address is never another tensor's while
//! registered). A weight that is another tensor is matched by the call's [`Signature`]
//! (weight shape, stride, dilation, groups, transposed) to a layer that has it and that could
//! have made that tensor: one whose parameter's memory it is (a `detach()`ed alias, as
//! non-reentrant checkpointing saves), one that computes its weight per call (a
//! parametrization, weight norm, pruning, a subclass's or instance's own `forward`), or one
//! whose parameter has another dtype than the call's weight now (autocast's cast, or a cast in
//! the model's code). Another
//! model's parameter of the same shape and dtype is therefore not claimed: an unconverted
//! copy of a converted model stays PyTorch's. One layer matched: its name; several (repeated
//! blocks), the name of the first with how many share it. A call no layer claims runs under
//! the switch's options when the switch is on (named by its problem), else PyTorch's kernel,
//! uncounted.
//!
//! Options are a [`Config`], shared by every layer (and the switch) given the same ones: plans
//! are kept per config and problem, so layers with one problem and one config share a tuning.
//! A config whose last holder goes releases its plans and its tuners.

use super::account::{Account, Counters};
use super::call::{Device, Dims, Signature};
use super::plans::TunerSlot;
use crate::c_abi::error::{invalid, FfiError};
use crate::c_abi::tuner::{parse_settings, TunerDevice};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// Where a config's measurements and plans are kept.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CacheChoice {
    /// mucudnn's default cache file (the CLI's).
    Default,
    /// In memory, for the process's life (one per device, shared by every such config).
    Memory,
    Path(PathBuf),
}

/// A set of layer options: how to tune (the C ABI's settings document), where to cache,
/// whether an unsupported problem falls back to PyTorch, and whether to log.
pub struct Config {
    pub id: u64,
    /// The canonical JSON it was made from (its identity).
    pub text: String,
    /// The C ABI settings document (`ops` and `deterministic` are decided per call).
    pub settings: String,
    pub cache: CacheChoice,
    pub fallback: bool,
    pub verbose: bool,
    /// The tuners it used, by device (it keeps them: an in-memory cache lives as long as the
    /// configs that use it).
    pub tuners: Mutex<HashMap<Device, Arc<TunerSlot>>>,
}

/// What Python sends for a config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigDocument {
    settings: serde_json::Value,
    cache: serde_json::Value,
    fallback: bool,
    verbose: bool,
}

impl Config {
    fn parse(id: u64, text: &str) -> Result<Config, FfiError> {
        let document: ConfigDocument =
            serde_json::from_str(text).map_err(|e| invalid(format!("layer options: {e}")))?;
        let cache = match &document.cache {
            serde_json::Value::Null => CacheChoice::Default,
            serde_json::Value::Bool(false) => CacheChoice::Memory,
            serde_json::Value::String(path) if !path.is_empty() => {
                CacheChoice::Path(PathBuf::from(path))
            }
            other => {
                return Err(invalid(format!(
                    "layer options: cache is {other}; give a file path, null (the default \
                     file) or false (in memory)"
                )))
            }
        };
        let settings = document.settings.to_string();
        // Checked now, so that a bad option fails where it is given, not at the first call.
        parse_settings(&settings, TunerDevice::Cpu)?;
        Ok(Config {
            id,
            text: text.to_string(),
            settings,
            cache,
            fallback: document.fallback,
            verbose: document.verbose,
            tuners: Mutex::default(),
        })
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        super::runtime_if_loaded(|runtime| runtime.plans.forget_config(self.id));
    }
}

/// Who a call runs for: a name (for messages and the account), its options, its counters.
pub struct Who {
    pub name: Arc<str>,
    pub config: Arc<Config>,
    pub counters: Arc<Counters>,
}

/// A converted layer.
pub struct Layer {
    pub signature: Signature,
    /// The address of the module's weight `TensorImpl` (0: none to match by).
    pub identity: usize,
    /// An owning `AtenTensorHandle` of the module's weight parameter (0: none): keeps its
    /// `TensorImpl` alive while registered, and tells its dtype now.
    pub weight: usize,
    /// The module computes the weight its convolution receives (no plain weight parameter,
    /// or a `forward` of its own).
    pub computes_weight: bool,
    pub who: Arc<Who>,
}

impl Drop for Layer {
    fn drop(&mut self) {
        if self.weight != 0 {
            super::runtime_if_loaded(|runtime| {
                // SAFETY: the owning handle this layer was given, deleted once.
                unsafe { (runtime.api.cpu.delete_tensor)(self.weight as *mut std::ffi::c_void) };
            });
        }
    }
}

/// What a call's weight is, for telling whether a layer made it.
#[derive(Clone, Copy, Debug)]
pub struct CallWeight {
    /// Its `TensorImpl`'s address.
    pub identity: usize,
    /// PyTorch's code of its dtype.
    pub dtype: i32,
    /// Its first element's address.
    pub data: usize,
}

impl Layer {
    /// Whether a call whose weight is another tensor than this layer's parameter may be this
    /// layer's (see the module docs).
    fn may_have_made(&self, weight: &CallWeight) -> bool {
        if self.computes_weight {
            return true;
        }
        if self.weight == 0 {
            return false;
        }
        let (mut dtype, mut data) = (weight.dtype, std::ptr::null_mut());
        super::runtime_if_loaded(|runtime| {
            let handle = self.weight as *mut std::ffi::c_void;
            // SAFETY: the live handle this layer owns; written to locals.
            unsafe {
                (runtime.api.cpu.get_dtype)(handle, &mut dtype);
                (runtime.api.cpu.get_data_ptr)(handle, &mut data);
            }
        });
        dtype != weight.dtype || data as usize == weight.data
    }
}

/// The layers of one signature, in registration order, and who a call claimed by the
/// signature runs for (the one layer's, or the first of several's with their count).
struct Group {
    layers: Vec<u64>,
    who: Arc<Who>,
}

/// The switch: its options, and the names of the problems it ran, made once each.
pub struct Switch {
    pub config: Arc<Config>,
    names: Mutex<HashMap<(Signature, Dims), Arc<Who>>>,
}

/// Every config, layer and the switch.
#[derive(Default)]
pub struct Registry {
    next_id: AtomicU64,
    configs: Mutex<HashMap<String, Weak<Config>>>,
    layers: std::sync::RwLock<Layers>,
    switch: std::sync::RwLock<Option<Arc<Switch>>>,
}

#[derive(Default)]
struct Layers {
    by_id: HashMap<u64, Arc<Layer>>,
    by_identity: HashMap<usize, u64>,
    by_signature: HashMap<Signature, Group>,
}

impl Registry {
    /// The config of `text`, made (and checked) on first use.
    pub fn config(&self, text: &str) -> Result<Arc<Config>, FfiError> {
        let mut configs = self.configs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(config) = configs.get(text).and_then(Weak::upgrade) {
            return Ok(config);
        }
        configs.retain(|_, weak| weak.strong_count() > 0);
        let config = Arc::new(Config::parse(self.next(), text)?);
        configs.insert(text.to_string(), Arc::downgrade(&config));
        Ok(config)
    }

    fn next(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Registers a layer; returns its id. `weight` is an owning handle of its weight
    /// parameter (0: none), whose `TensorImpl` is `identity` (0: none).
    #[allow(clippy::too_many_arguments)]
    pub fn add_layer(
        &self,
        account: &Account,
        name: &str,
        config: Arc<Config>,
        signature: Signature,
        identity: usize,
        weight: usize,
        computes_weight: bool,
    ) -> u64 {
        let id = self.next();
        let name: Arc<str> = Arc::from(name);
        let who = Arc::new(Who {
            counters: account.counters(&name),
            name,
            config,
        });
        let layer = Arc::new(Layer {
            signature,
            identity,
            weight,
            computes_weight,
            who,
        });
        let mut layers = self.layers.write().unwrap_or_else(PoisonError::into_inner);
        if identity != 0 {
            layers.by_identity.insert(identity, id);
        }
        layers.by_id.insert(id, layer);
        layers.regroup(account, signature);
        id
    }

    /// Unregisters a layer (`false`: no such layer).
    pub fn remove_layer(&self, account: &Account, id: u64) -> bool {
        let removed = {
            let mut layers = self.layers.write().unwrap_or_else(PoisonError::into_inner);
            let Some(layer) = layers.by_id.remove(&id) else {
                return false;
            };
            if layer.identity != 0 && layers.by_identity.get(&layer.identity) == Some(&id) {
                layers.by_identity.remove(&layer.identity);
            }
            layers.regroup(account, layer.signature);
            layer
        };
        // The config (and its plans) may go with it: outside the lock.
        drop(removed);
        true
    }

    pub fn layer_count(&self) -> usize {
        self.layers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .by_id
            .len()
    }

    /// The layer of a call: by its weight, else by its signature (see the module docs).
    pub fn claim(&self, weight: &CallWeight, signature: &Signature) -> Option<Arc<Who>> {
        let layers = self.layers.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(layer) = layers
            .by_identity
            .get(&weight.identity)
            .and_then(|id| layers.by_id.get(id))
        {
            if layer.signature == *signature {
                return Some(layer.who.clone());
            }
        }
        let group = layers.by_signature.get(signature)?;
        group
            .layers
            .iter()
            .any(|id| layers.by_id[id].may_have_made(weight))
            .then(|| group.who.clone())
    }

    /// Turns the switch on with `config` (replacing an earlier one), or off.
    pub fn set_switch(&self, config: Option<Arc<Config>>) {
        let switch = config.map(|config| {
            Arc::new(Switch {
                config,
                names: Mutex::new(HashMap::new()),
            })
        });
        let old = std::mem::replace(
            &mut *self.switch.write().unwrap_or_else(PoisonError::into_inner),
            switch,
        );
        drop(old);
    }

    pub fn switch(&self) -> Option<Arc<Switch>> {
        self.switch
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether anything can claim a call (a layer, or the switch): else the kernels need not
    /// be registered.
    pub fn is_idle(&self) -> bool {
        self.layer_count() == 0 && self.switch().is_none()
    }
}

impl Switch {
    /// Who a call the switch runs is for: named by its problem (once per signature and
    /// padding).
    pub fn who(&self, account: &Account, signature: &Signature, padding: &Dims) -> Arc<Who> {
        let mut names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        names
            .entry((*signature, *padding))
            .or_insert_with(|| {
                let name: Arc<str> = Arc::from(super::call::problem_name(signature, padding));
                Arc::new(Who {
                    counters: account.counters(&name),
                    name,
                    config: self.config.clone(),
                })
            })
            .clone()
    }
}

impl Layers {
    /// Recomputes who the calls of `signature` run for after a layer came or went.
    fn regroup(&mut self, account: &Account, signature: Signature) {
        let mut ids: Vec<u64> = self
            .by_id
            .iter()
            .filter(|(_, layer)| layer.signature == signature)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        match ids.as_slice() {
            [] => {
                self.by_signature.remove(&signature);
            }
            [only] => {
                let who = self.by_id[only].who.clone();
                self.by_signature
                    .insert(signature, Group { layers: ids, who });
            }
            [first, rest @ ..] => {
                let first = &self.by_id[first].who;
                let name: Arc<str> = Arc::from(format!(
                    "{} (or {} more of its shape)",
                    first.name,
                    rest.len()
                ));
                let who = Arc::new(Who {
                    counters: account.counters(&name),
                    name,
                    config: first.config.clone(),
                });
                self.by_signature
                    .insert(signature, Group { layers: ids, who });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch::call::module_signature;

    const OPTIONS: &str =
        r#"{"settings":{"policy":"undivided"},"cache":false,"fallback":true,"verbose":false}"#;

    #[test]
    fn configs_are_shared_and_checked() {
        let registry = Registry::default();
        let a = registry.config(OPTIONS).unwrap();
        let b = registry.config(OPTIONS).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.cache, CacheChoice::Memory);
        let bad = registry
            .config(r#"{"settings":{"policy":"sometimes"},"cache":null,"fallback":true,"verbose":false}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(bad.contains("policy"), "{bad}");
        let unknown = registry
            .config(r#"{"settings":{},"cache":null,"fallback":true,"verbose":false,"x":1}"#)
            .err()
            .unwrap()
            .to_string();
        assert!(unknown.contains("unknown field"), "{unknown}");
    }

    #[test]
    fn calls_are_claimed_by_weight_then_signature() {
        let registry = Registry::default();
        let account = Account::default();
        let config = registry.config(OPTIONS).unwrap();
        let sig = module_signature(false, &[4, 3, 3, 3], &[1, 1], &[1, 1], 1).unwrap();
        let other = module_signature(false, &[8, 4, 3, 3], &[1, 1], &[1, 1], 1).unwrap();
        let tensor = |identity| CallWeight {
            identity,
            dtype: 6,
            data: identity + 64,
        };
        // A layer holding its weight (no handle here: its dtype and memory cannot be read).
        let a = registry.add_layer(&account, "a", config.clone(), sig, 0x1000, 0, false);
        assert_eq!(&*registry.claim(&tensor(0x1000), &sig).unwrap().name, "a");
        // Another tensor of its shape is not its weight.
        assert!(registry.claim(&tensor(0x9999), &sig).is_none());
        // Its address with another signature claims nothing.
        assert!(registry.claim(&tensor(0x1000), &other).is_none());
        // A layer that computes its weight claims any call of its signature.
        let b = registry.add_layer(&account, "b", config.clone(), sig, 0x2000, 0, true);
        assert_eq!(&*registry.claim(&tensor(0x2000), &sig).unwrap().name, "b");
        assert_eq!(
            &*registry.claim(&tensor(0x3000), &sig).unwrap().name,
            "a (or 1 more of its shape)"
        );
        assert!(registry.remove_layer(&account, a));
        assert!(!registry.remove_layer(&account, a));
        assert_eq!(&*registry.claim(&tensor(0x3000), &sig).unwrap().name, "b");
        assert!(registry.remove_layer(&account, b));
        assert!(registry.claim(&tensor(0x2000), &sig).is_none());
        assert!(registry.is_idle());
        registry.set_switch(Some(config));
        assert!(!registry.is_idle());
        registry.set_switch(None);
        assert!(registry.is_idle());
    }
}
