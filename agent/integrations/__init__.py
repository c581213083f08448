"""Framework integrations (`ampwatch.integrations`): attach the agent the way each
framework's users attach things, and make its data as exact as a plain torch.amp loop's.

One module per framework, each importing its framework only when used (installing ampwatch
never installs a framework: `pip install 'ampwatch[lightning]'` etc.):

- `ampwatch.integrations.lightning.AmpwatchCallback`: `Trainer(callbacks=[...])`
- `ampwatch.integrations.transformers.AmpwatchCallback`: HF `Trainer(callbacks=[...])`
- `ampwatch.integrations.accelerate`: `watch(model, optimizer, accelerator=accelerator)`

The folder lives under `agent/` (the top-level layout is fixed) and is installed as
`ampwatch.integrations` (setuptools `package-dir`).
"""
